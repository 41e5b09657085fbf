"""How often a checkpoint is full and how many are kept (`training.checkpoint_every`,
`training.keep_checkpoints`): every committed step is durable, but only every n-th (and the last)
carries the optimizer state; the steps between are a third of the size; a trainer resuming from
one of those has the step's weights and the optimizer state of the full checkpoint before it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from services.common.runconfig import LearnJob, ModelConfig, RunConfig
from services.learning.checkpoint import checkpoints, read
from services.learning.learner import Learner
from tests.learning_samples import random_groups


def _run(model: ModelConfig, every: int, keep: int) -> RunConfig:
    training = {"checkpoint_every": every, "keep_checkpoints": keep, "steps": 7, "lr": 1e-3}
    training |= {"micro_batch": 2, "torch_threads": 1}
    return RunConfig.model_validate({"model": model.model_dump(), "training": training})


def _names(directory: Path) -> list[str]:
    return [p.name for p in checkpoints(directory)]


def _step(learner: Learner, step: int) -> Path:
    samples = random_groups(step, version=learner.state.version)
    learner.step(samples)
    return learner.commit({s.trajectory_id for s in samples})


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_full_every_n_steps_weights_between_and_a_resume_takes_the_last_full_optimizer_state(
    tiny_model: ModelConfig, tmp_path: Path
) -> None:
    run = _run(tiny_model, every=3, keep=1)
    learner = Learner(LearnJob.of(run), tmp_path)
    at_step_3: dict[str, Any] = {}
    for step in range(1, 6):
        _step(learner, step)
        if step == 3:
            at_step_3 = copy.deepcopy(learner.optimizer.state_dict())
    # step 3 full (the one kept), 4 and 5 the weights only (the two newest are always kept)
    assert _names(tmp_path) == [
        "step_00000003-e0.pt",
        "step_00000004-e0-weights.pt",
        "step_00000005-e0-weights.pt",
    ]
    full, weights = (tmp_path / n for n in ("step_00000003-e0.pt", "step_00000005-e0-weights.pt"))
    assert read(weights)["optimizer"] is None and read(full)["optimizer"]["state"]
    assert weights.stat().st_size < 0.5 * full.stat().st_size  # Adam: two moments per weight

    resumed = Learner(LearnJob.of(run), tmp_path)
    assert resumed.resume() == weights and resumed.optimizer_from == full
    assert (resumed.state.step, resumed.state.version) == (5, 5)
    assert resumed.state.trained_ids == learner.state.trained_ids  # the ledger is every step's
    _assert_same(resumed.model.state_dict(), learner.model.state_dict())
    _assert_same(resumed.optimizer.state_dict(), at_step_3)

    for step in (6, 7):
        _step(learner, step)
    assert _names(tmp_path) == ["step_00000006-e0.pt", "step_00000007-e0.pt"]  # 7 is the last: full


def test_a_resume_with_no_full_checkpoint_left_starts_a_fresh_optimizer(
    tiny_model: ModelConfig, tmp_path: Path
) -> None:
    run = _run(tiny_model, every=5, keep=1)
    learner = Learner(LearnJob.of(run), tmp_path)
    for step in (1, 2):
        _step(learner, step)
    assert _names(tmp_path) == ["step_00000001-e0-weights.pt", "step_00000002-e0-weights.pt"]
    resumed = Learner(LearnJob.of(run), tmp_path)
    assert resumed.resume() is not None and resumed.optimizer_from is None
    assert not resumed.optimizer.state_dict()["state"]
    _assert_same(resumed.model.state_dict(), learner.model.state_dict())


def test_every_step_full_keeps_what_it_always_kept(tiny_model: ModelConfig, tmp_path: Path) -> None:
    learner = Learner(LearnJob.of(_run(tiny_model, every=1, keep=2)), tmp_path)
    for step in range(1, 5):
        _step(learner, step)
    assert _names(tmp_path) == ["step_00000003-e0.pt", "step_00000004-e0.pt"]
