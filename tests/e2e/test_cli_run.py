"""`libra run` as a user types it: overrides on the command line, output where asked, and the
trained policy in Hugging Face format at the end (and again with `libra export`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from tools.stack import ROOT

pytestmark = pytest.mark.e2e
RUN = f"cli-run-{uuid.uuid4().hex[:8]}"  # run ids are durable: a rerun of one would resume it


def _libra(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")} | {"HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_run_with_overrides_writes_a_policy_transformers_loads(tmp_path: Path) -> None:
    import transformers

    out = _libra(
        "run", "configs/tiny.yaml", "--training.steps", "3", "task.max_turns=1", "--training.save_every=2",
        "--task.top_p", "0.9", "training.filter_zero_advantage=false",
        "--output-dir", str(tmp_path), "--run-id", RUN,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / RUN
    report = json.loads((run / "report.json").read_text())
    assert report["train_steps"] == 3 and report["final_weight_version"] == 3
    sent = yaml.safe_load((run / "config.yaml").read_text())
    assert sent["training"]["steps"] == 3 and sent["task"]["max_turns"] == 1
    # top_p reached the engines: their logprobs are under the nucleus, the trainer's under the full
    # distribution, so the mismatch on step 1 (same weights) is log(1 / nucleus mass), not ~1e-6
    assert report["logprob_mismatch_per_step"][0] > 0.01
    assert Path(report["checkpoint"]).parent == run / "checkpoints"
    assert report["final_policy"] == str(run / "final")

    trained = torch.load(report["checkpoint"], map_location="cpu", weights_only=True)["model"]
    policy = transformers.AutoModelForCausalLM.from_pretrained(str(run / "final"))
    for name, tensor in policy.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    assert transformers.AutoTokenizer.from_pretrained(str(run / "final")).eos_token_id is not None
    assert json.loads((run / "final" / "libra.json").read_text())["step"] == 3
    # training.save_every=2: the trainer wrote step 2's policy itself (and no other)
    (saved,) = (run / "checkpoints" / "hf").iterdir()
    assert saved.name == "step_00000002" and json.loads((saved / "libra.json").read_text())["step"] == 2
    assert (
        transformers.AutoModelForCausalLM.from_pretrained(str(saved)).config.vocab_size
        == policy.config.vocab_size
    )

    again = _libra("export", RUN, "--runs-dir", str(tmp_path), "--out", str(tmp_path / "exported"))
    assert again.returncode == 0, again.stderr
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))
    assert all(torch.equal(t, trained[n]) for n, t in exported.state_dict().items())
    missing = _libra("export", "no-such-run", "--runs-dir", str(tmp_path))
    assert missing.returncode == 2 and "no run at" in missing.stderr
