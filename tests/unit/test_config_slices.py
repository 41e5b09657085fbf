"""Components take the part of the run config they read (`EngineJob` for the rollout engines'
library, `LearnJob` for training's), so that what one reads is visible at its signature and a test builds just that part."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.runconfig import EngineJob, LearnJob, RunConfig

ROOT = Path(__file__).resolve().parents[2]


def test_an_engine_job_is_the_model_the_rollout_and_the_longest_turn() -> None:
    run = RunConfig.model_validate(
        {"task": {"max_context_tokens": 1024, "max_new_tokens": 64}, "rollout": {"max_batch": 8}}
    )
    job = EngineJob.of(run)
    assert job.model is run.model and job.rollout is run.rollout
    assert (job.max_new_tokens, job.max_context_tokens, job.max_sequence_tokens) == (64, 1024, 1088)


def test_a_learn_job_is_what_training_reads_and_crosses_to_the_ranks_as_json() -> None:
    run = RunConfig.model_validate(
        {
            "task": {"top_p": 0.9, "overlong": {"filter": True}, "dataset": "arithmetic"},
            "training": {"lr": 3e-6, "fsdp": 2},
            "rollout": {"backend": "emulated", "emulated": {"time_scale": 0.5}},
        }
    )
    job = LearnJob.of(run)
    assert job.model is run.model and job.training is run.training
    assert (job.top_p, job.overlong_filter, job.drop_zero_advantage) == (0.9, True, True)
    assert (job.rollout_backend, job.emulated.time_scale) == ("emulated", 0.5)
    again = LearnJob.from_json(job.to_json())
    assert again == job and again.training.lr == 3e-6


@pytest.mark.parametrize(("package", "part"), [("generation", "EngineJob"), ("learning", "LearnJob")])
def test_the_engine_and_training_libraries_never_take_the_whole_run_config(package: str, part: str) -> None:
    named = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "services" / package).rglob("*.py"))
        if "RunConfig" in p.read_text()
    ]
    assert not named, f"services/{package} takes a {part}, not a RunConfig: {named}"
