"""Components take the part of the run config they read (`EngineJob` for the rollout engines'
library), so that what one reads is visible at its signature and a test builds just that part."""

from __future__ import annotations

from pathlib import Path

from services.common.runconfig import EngineJob, RunConfig

ROOT = Path(__file__).resolve().parents[2]


def test_an_engine_job_is_the_model_the_rollout_and_the_longest_turn() -> None:
    run = RunConfig.model_validate(
        {"task": {"max_context_tokens": 1024, "max_new_tokens": 64}, "rollout": {"max_batch": 8}}
    )
    job = EngineJob.of(run)
    assert job.model is run.model and job.rollout is run.rollout
    assert (job.max_new_tokens, job.max_context_tokens, job.max_sequence_tokens) == (64, 1024, 1088)


def test_the_generation_library_never_takes_the_whole_run_config() -> None:
    named = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "services" / "generation").rglob("*.py"))
        if "RunConfig" in p.read_text()
    ]
    assert not named, f"services/generation takes an EngineJob, not a RunConfig: {named}"
