"""Components take the part of the run config they read (`EngineJob` for the rollout engines'
library, `LearnJob` for training's, `PlanJob` for the planner's parts, a section or a value for the
rest), so that what one reads is visible at its signature and a test builds just that part. Only a
service's shell (`service.py`), which parses the job, and the planner's re-fit, which simulates the
whole job, take the whole `RunConfig`."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.runconfig import EngineJob, LearnJob, PlanJob, RunConfig

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


def test_a_plan_job_is_what_the_planner_places_engines_by() -> None:
    run = RunConfig.model_validate(
        {
            "rollout": {"engines": 3, "buckets": [{"name": "s", "max_output_tokens": 512}, {"name": "l"}]},
            "job": {"lease_ttl_s": 7},
            "training": {"groups_per_step": 5},
        }
    )
    job = PlanJob.of(run)
    assert job.rollout is run.rollout and job.planner is run.planner
    assert (job.bucket_engines, job.lending_bucket) == ({"s": 2, "l": 1}, run.lending_bucket)
    assert (job.lease_ttl_s, job.groups_per_step) == (7, 5)


JOB_READERS = {"planner/refit.py", "planner/refitting.py"}
"""The planner's re-fit simulates each candidate as the whole job (`services/simulation/whatif.py`)."""


@pytest.mark.parametrize("package", ["scheduler", "planner", "trainer", "rollout_engine", "tool_sandbox"])
def test_below_its_shell_a_service_takes_a_part_of_the_run_config(package: str) -> None:
    named = [
        str(p.relative_to(ROOT / "services"))
        for p in sorted((ROOT / "services" / package).rglob("*.py"))
        if p.name != "service.py" and "RunConfig" in p.read_text()
    ]
    assert not [n for n in named if n not in JOB_READERS], f"services/{package}: whole RunConfig in {named}"
