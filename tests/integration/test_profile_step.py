"""`python -m tools.profile_step`: one training micro-batch's peak memory and time, with and without
activation recomputation, on the tiny model (in its own process, as users run it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.models import ModelConfig, resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _profile(model_dir: Path, *flags: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tools.profile_step", "--model", str(model_dir), "--batch", "2",
         "--length", "24", "--threads", "1", *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_micro_batch_is_profiled_the_same_with_and_without_recomputing_its_activations(
    tiny_model: ModelConfig,
) -> None:
    model_dir = resolve_model_dir(tiny_model)
    kept, recomputed = _profile(model_dir, "--no-gradient-checkpointing"), _profile(model_dir)
    assert (kept["gradient_checkpointing"], recomputed["gradient_checkpointing"]) == (False, True)
    for got in (kept, recomputed):
        assert (got["batch"], got["length"], got["threads"]) == (2, 24, 1)
        assert got["step_s"] > 0 and got["peak_rss_gib"] >= got["rss_before_steps_gib"] > 0
    # the same weights and tokens: recomputing changes what is kept, not what is computed
    assert abs(kept["logprob_sum"] - recomputed["logprob_sum"]) < 1e-4 * abs(kept["logprob_sum"])
