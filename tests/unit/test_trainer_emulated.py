"""The emulated trainer (control-plane and fidelity runs): a step takes the cost model's time and
changes no weight; everything around it (versions, checkpoints, pushes) is real."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.cost_model import load_presets
from services.common.runconfig import LearnJob, ModelConfig, RunConfig
from services.learning.data import Sample
from services.learning.learner import Learner
from services.learning.step import StepAborted


def _run(model: ModelConfig, scale: float) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": model.model_dump(),
            "rollout": {"emulated": {"gpu": "H100", "model": "qwen3-14b", "time_scale": scale}},
            "training": {"backend": "emulated", "emulated_gpus": 16, "emulated_tp": 2},
        }
    )


def _samples() -> list[Sample]:
    return [
        Sample(f"t{i}", f"g{i // 2}", float(i % 2), [5] * n, [False] * 10 + [True] * (n - 10), [0.0] * n)
        for i, n in enumerate((4000, 12000, 800, 30000))
    ]


def test_an_emulated_step_takes_the_cost_models_time_and_changes_no_weight(
    tiny_model: ModelConfig, tmp_path: Path
) -> None:
    learner = Learner(LearnJob.of(_run(tiny_model, 1e-4)), tmp_path)
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    stats = learner.step(_samples())
    lengths = [4000, 12000, 800, 30000]
    cm = load_presets("H100", "qwen3-14b")
    want = cm.train_step_s(sum(lengths), sum(lengths) / 4, 16, 2, max(lengths))
    assert stats.seconds == pytest.approx(want * 1e-4)
    assert stats.trajectories == 4 and stats.tokens == sum(n - 10 for n in lengths)
    assert stats.reward_mean == pytest.approx(0.5)
    assert all(torch.equal(v, before[k]) for k, v in learner.model.state_dict().items())
    learner.commit({"t0", "t1"})
    assert learner.state.version == 1


def test_emulated_training_pushes_a_stand_in_to_emulated_engines_only(
    tiny_model: ModelConfig, tmp_path: Path
) -> None:
    """Emulated engines keep no weights, so the push carries a few bytes (its real transfer time
    would be scaled up by 1/time_scale); real engines still get the whole model."""
    to_emulated = _run(tiny_model, 1e-4).model_copy(deep=True)
    to_emulated.rollout.backend = "emulated"
    small = Learner(LearnJob.of(to_emulated), tmp_path / "a").snapshot()
    assert small.nbytes < 1024 and small.version == 0
    assert small.names == ["emulated.version"]
    whole = Learner(LearnJob.of(_run(tiny_model, 1e-4)), tmp_path / "b").snapshot()
    assert whole.nbytes > 100 * small.nbytes
    assert "emulated.version" not in whole.names and whole.dtype == "float32"


def test_an_emulated_step_can_be_abandoned(tiny_model: ModelConfig, tmp_path: Path) -> None:
    learner = Learner(LearnJob.of(_run(tiny_model, 100.0)), tmp_path)
    with pytest.raises(StepAborted):
        learner.step(_samples(), should_abort=lambda: True)
