"""A hybrid replica's gradients: a training step computed by the trainer and one or two extra
data-parallel replicas (real processes over torch.distributed gloo) gives the same update as the
trainer alone on the same batch, up to floating-point reduction order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.runconfig import ModelConfig
from services.learning.data_parallel import share
from tests.dp_rig import assert_same_update, step

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_micro_batches_are_dealt_round_robin_and_every_one_exactly_once() -> None:
    batches = list(range(7))
    shares = [share(batches, r, 3) for r in range(3)]
    assert shares == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(x for s in shares for x in s) == batches
    with pytest.raises(ValueError):
        share(batches, 3, 3)


@pytest.mark.parametrize(("world", "minis"), [(2, 1), (3, 1), (2, 2)])
def test_a_step_with_hybrid_replicas_updates_the_weights_as_the_trainer_alone(
    tiny_model: ModelConfig, tmp_path: Path, world: int, minis: int
) -> None:
    """With two mini-batches the second one's gradients are taken on the weights after the first
    update, on every replica (rank 0 sends them), and its clip now bounds something."""
    alone, alone_stats = step(tiny_model.cache_dir, mini_batches=minis)
    assert alone_stats["updates"] == minis
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    init = tmp_path / "init"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.dp_rig",
                str(r),
                str(world),
                str(init),
                tiny_model.cache_dir,
                str(tmp_path),
                str(minis),
            ],
            cwd=ROOT,
            env=env,
        )
        for r in range(world)
    ]
    for p in procs:
        assert p.wait(timeout=300) == 0
    from services.common.models import load_model

    torch.manual_seed(0)
    initial = load_model(tiny_model).state_dict()
    trainer = torch.load(tmp_path / "weights-0.pt")
    assert_same_update(trainer, alone.state_dict(), initial)
    hybrid = torch.load(tmp_path / "weights-1.pt")
    if minis == 1:
        assert all(torch.equal(hybrid[k], initial[k]) for k in initial), "a hybrid replica does not step"
    else:  # it received the weights after the first update, not the last
        assert not all(torch.equal(hybrid[k], initial[k]) for k in initial)
        assert not all(torch.equal(hybrid[k], trainer[k]) for k in initial)
    stats = [json.loads((tmp_path / f"stats-{r}.json").read_text()) for r in range(world)]
    for s in stats:  # every replica reports the whole step
        assert s["tokens"] == alone_stats["tokens"]
        assert s["loss"] == pytest.approx(alone_stats["loss"], rel=1e-5, abs=1e-7)
        assert s["grad_norm"] == pytest.approx(alone_stats["grad_norm"], rel=1e-5)
        assert s["kl"] == pytest.approx(alone_stats["kl"], rel=1e-5, abs=1e-9)
        assert s["updates"] == minis
        assert s["entropy"] == pytest.approx(alone_stats["entropy"], rel=1e-5)
        assert s["clip_fraction"] == pytest.approx(alone_stats["clip_fraction"], abs=1e-6)
