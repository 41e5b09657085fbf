"""`libra run` as a user types it: overrides on the command line, output where asked, and the
trained policy in Hugging Face format at the end (and again with `libra export`); the rollouts run
on vLLM (`rollout.backend: vllm`, its CPU build) and the trainer shards the policy over two
processes (FSDP on gloo), so its pushes, checkpoints and exports are the sharded path's."""

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

from tests import in_process
from tools.stack import ROOT

pytestmark = pytest.mark.e2e
RUN = f"cli-run-{uuid.uuid4().hex[:8]}"  # run ids are durable: a rerun of one would resume it


def _libra(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
    env |= {"HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "tools.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_run_with_overrides_writes_a_policy_transformers_loads(tmp_path: Path) -> None:
    import transformers

    project = tmp_path / "project"  # a user's directory, not the repository: the shipped config by name
    project.mkdir()
    cache = ROOT / ".libra" / "models"  # the tiny model the session already built
    out = _libra(
        "run", "tiny", "--training.steps", "2", "task.max_turns=1", "--training.save_every=2",
        "--task.top_p", "0.9", "training.filter_zero_advantage=false", f"--model.cache_dir={cache}",
        "--training.fsdp", "2", "--rollout.backend", "vllm", "--rollout.engines", "1",
        "--output-dir", "out", "--run-id", RUN, cwd=project,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    run = project / "out" / RUN
    assert (project / ".libra" / "data" / f"embedded-{RUN}").is_dir()  # the stack's state is the caller's
    report = json.loads((run / "report.json").read_text())
    assert report["train_steps"] == 2 and report["final_weight_version"] == 2
    assert report["rollout_backend"] == "vllm" and report["all_engines_on_final_version"]
    assert any(w["delta_engines"] for w in report["weight_push"]), "vLLM takes deltas after the first push"
    (engine,) = report["engines"]  # what it generated, and how much of its prompts vLLM found cached
    assert engine["tokens_generated"] > 0 and 0.0 <= engine["prefix_cache_hit_rate"] <= 1.0, engine
    assert (report["trajectories_lost"], report["trajectories_trained_twice"]) == (0, 0)
    trainer_log = (run / "logs" / "trainer.log").read_text()
    assert trainer_log.count('"data_parallel": 2') == 2  # every step on both FSDP ranks
    sent = yaml.safe_load((run / "config.yaml").read_text())
    assert sent["training"]["steps"] == 2 and sent["task"]["max_turns"] == 1
    # top_p reached vLLM and the trainer alike: both score tokens under the nucleus, so on step 1
    # (same weights, float32) they agree (scoring the full distribution gave log(1 / nucleus
    # mass), about 0.1 here, before the trainer knew top_p)
    assert sent["task"]["top_p"] == 0.9
    assert report["logprob_mismatch_per_step"][0] < 1e-3
    assert Path(report["checkpoint"]).parent == run / "checkpoints"
    assert report["final_policy"] == str(run / "final")

    trained = torch.load(report["checkpoint"], map_location="cpu", weights_only=True)["model"]
    policy = transformers.AutoModelForCausalLM.from_pretrained(str(run / "final"))
    for name, tensor in policy.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    assert transformers.AutoTokenizer.from_pretrained(str(run / "final")).eos_token_id is not None
    assert json.loads((run / "final" / "libra.json").read_text())["step"] == 2
    # training.save_every=2: the trainer wrote step 2's policy itself (and no other), as well as
    # the final one `libra run` exports
    (saved,) = (run / "checkpoints" / "hf").iterdir()
    assert saved.name == "step_00000002" and json.loads((saved / "libra.json").read_text())["step"] == 2
    assert (
        transformers.AutoModelForCausalLM.from_pretrained(str(saved)).config.vocab_size
        == policy.config.vocab_size
    )

    again = _libra("export", RUN, "--runs-dir", str(project / "out"), "--out", str(tmp_path / "exported"))
    assert again.returncode == 0, again.stderr
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exported"))
    assert all(torch.equal(t, trained[n]) for n, t in exported.state_dict().items())
    missing = in_process.libra("export", "no-such-run", "--runs-dir", str(tmp_path))
    assert missing.returncode == 2 and "no run at" in missing.stderr


def test_run_on_a_stack_reached_by_its_endpoints(tmp_path: Path) -> None:
    """What the compose and k8s job containers do: `libra run --nats-url --redis-url --secrets` on a
    stack this process did not start and knows no stack file of (another directory, here)."""
    from services.common.runconfig import load_run_config
    from tools.stack import Stack

    project = tmp_path / "elsewhere"
    project.mkdir()
    stack = Stack(f"remote-{uuid.uuid4().hex[:6]}", tmp_path / "logs")
    stack.start_infra(load_run_config(ROOT / "configs" / "tiny.yaml").rollout.engines)
    try:
        stack.start_services()
        assert stack.credentials is not None
        endpoints = ["--nats-url", stack.nats_url, "--redis-url", stack.redis_url]
        run_id = f"remote-{uuid.uuid4().hex[:8]}"
        common = [
            "--training.steps",
            "2",
            f"--model.cache_dir={ROOT / '.libra' / 'models'}",
            "--output-dir",
            "out",
        ]
        # with LoRA: the trainer pushes the merged weights, the export adds the adapter; a reward
        # that differs between any two different texts (their checksum) gives the random model's
        # groups advantages to train on (the parity of the length left all four groups of the job
        # without one about once in sixteen runs: one CI run)
        (project / "checksum.py").write_text(
            "import zlib\n\ndef score(response, **_):\n    return zlib.crc32(response.encode()) / 2**32\n"
        )
        lora = [
            "training.lora={rank: 4, alpha: 8}",
            "task.reward=checksum:score",
            "task.plugin_paths=[.]",
            "training.lr=1e-3",
            "training.filter_zero_advantage=false",
        ]
        out = _libra("run", "tiny", *endpoints, "--secrets", str(stack.credentials.root), *common,
                     "--run-id", run_id, *lora, cwd=project)  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads((project / "out" / run_id / "report.json").read_text())
        assert report["status"] == "completed" and report["train_steps"] == 2
        assert report["all_engines_on_final_version"], report["engines"]
        assert all(m is None or m < 1e-3 for m in report["logprob_mismatch_per_step"])
        assert report["stack"] == f"remote {stack.nats_url}" and report["logs"] is None
        assert report["turn_context_tokens"]["sent"] > 0  # (its one-turn trajectories hold nothing)
        final = project / "out" / run_id / "final"
        assert (final / "config.json").is_file()  # exported from the checkpoint
        from safetensors.torch import load_file

        adapter = load_file(str(final / "adapter" / "adapter_model.safetensors"))
        trained = [k for k, v in adapter.items() if "lora_B" in k and bool(v.abs().sum() > 0)]
        assert trained, "the job trained the adapter (B starts at zero)"
        assert sum(report["groups_informative_per_step"]) > 0
        assert not (project / ".libra" / "stack.json").exists()

        # without the stack's credentials the CLI is refused, with a message and nothing started
        refused = _libra("run", "tiny", *endpoints, *common, "--run-id", f"{run_id}-x", cwd=project)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
        assert f"the stack at {stack.nats_url} refused the CLI (unauthenticated)" in refused.stderr
        missing = _libra("run", "tiny", "--nats-url", stack.nats_url, cwd=project)
        assert missing.returncode == 2 and "needs both --nats-url and --redis-url" in missing.stderr
    finally:
        stack.stop()
