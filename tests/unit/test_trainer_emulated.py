"""The emulated trainer (control-plane and fidelity runs): a step takes the cost model's time and
changes no weight; everything around it (versions, checkpoints, pushes) is real."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.cost_model import load_presets
from services.common.runconfig import ModelConfig, RunConfig
from services.trainer.data import Sample
from services.trainer.learner import Learner
from services.trainer.step import StepAborted


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
    learner = Learner(_run(tiny_model, 1e-4), tmp_path)
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
    from services.common.weights import read_header

    to_emulated = _run(tiny_model, 1e-4).model_copy(deep=True)
    to_emulated.rollout.backend = "emulated"
    small = Learner(to_emulated, tmp_path / "a").pack()
    assert small.size < 1024 and small.version == 0
    assert set(read_header(small.blob)) == {"emulated.version"}
    whole = Learner(_run(tiny_model, 1e-4), tmp_path / "b").pack()
    assert whole.size > 100 * small.size
    assert "emulated.version" not in read_header(whole.blob)


def test_an_emulated_step_can_be_abandoned(tiny_model: ModelConfig, tmp_path: Path) -> None:
    learner = Learner(_run(tiny_model, 100.0), tmp_path)
    with pytest.raises(StepAborted):
        learner.step(_samples(), should_abort=lambda: True)


def test_a_safetensors_header_is_read_without_torch_and_garbage_is_refused() -> None:
    from services.common.weights import pack_state_dict, read_header

    blob = pack_state_dict({"a.weight": torch.zeros(3, 4), "b": torch.ones(2)})
    assert read_header(blob) == {"a.weight": (3, 4), "b": (2,)}
    for bad in (b"", b"\x00" * 4, b"\xff" * 64, (5).to_bytes(8, "little") + b"nope!"):
        with pytest.raises(ValueError):
            read_header(bad)
