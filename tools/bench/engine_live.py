"""The live stack on each rollout backend: one `libra run` of the default job (SmolLM2-135M, two
engines, the CPU trainer, the embedded NATS and Redis) with `rollout.backend: hf`, then with
`vllm`, on this machine, in the same run of the benchmark.

What it reports per backend: the job's wall time and trajectories/s (from its report), whether
the job lost or trained twice any trajectory, and the least memory the machine had available
while it ran (sampled from /proc/meminfo every second): two vLLM engines and the trainer must
fit beside each other without swapping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

NAME = "engine_live"
CONFIG = "default"
BACKENDS = ("hf", "vllm")
TIMEOUT_S = 1500


def _available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _job(backend: str, out: Path) -> dict[str, Any]:
    from tools.stack import ROOT

    run_id = f"bench-{backend}-{uuid.uuid4().hex[:6]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")} | {"HF_HUB_OFFLINE": "1"}
    lowest = [_available_mib()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(1.0):
            lowest[0] = min(lowest[0], _available_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tools.cli", "run", CONFIG, "--rollout.backend", backend,
             "--output-dir", str(out), "--run-id", run_id, "--timeout", str(TIMEOUT_S)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S + 120,
        )  # fmt: skip
    finally:
        done.set()
        sampler.join()
    report = json.loads((out / run_id / "report.json").read_text())
    if proc.returncode != 0:
        raise RuntimeError(f"libra run {CONFIG} on {backend}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return {
        "wall_s": report["wall_s"],
        "command_s": time.monotonic() - started,
        "trajectories_per_s": report["trajectories_per_s"],
        "trajectories_completed": report["trajectories_completed"],
        "lost": report["trajectories_lost"],
        "trained_twice": report["trajectories_trained_twice"],
        "all_engines_on_final_version": report["all_engines_on_final_version"],
        "logprob_mismatch_per_step": report["logprob_mismatch_per_step"],
        "min_available_mib": lowest[0],
        "swap_total_mib": _swap_total_mib(),
    }


def _swap_total_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("SwapTotal:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {backend: _job(backend, Path(tmp)) for backend in BACKENDS}
    hf, vllm = jobs["hf"], jobs["vllm"]
    ratio = vllm["trajectories_per_s"] / hf["trajectories_per_s"]
    rows = [
        [
            f"`libra run {CONFIG}`: trajectories/s vllm / hf",
            f"{ratio:.2f}x",
            f"vllm {vllm['trajectories_per_s']:.3f} ({vllm['wall_s']:.0f} s), "
            f"hf {hf['trajectories_per_s']:.3f} ({hf['wall_s']:.0f} s); one job each, engines eager, float32",
        ]
    ]
    for name, j in jobs.items():
        mismatch = [m for m in j["logprob_mismatch_per_step"] if m is not None]
        rows.append(
            [
                f"{name}: lost / trained twice / engines on the final version",
                f"{j['lost']} / {j['trained_twice']} / {j['all_engines_on_final_version']}",
                f"least memory available {j['min_available_mib'] / 1024:.1f} GiB (swap "
                f"{j['swap_total_mib']:.0f} MiB); logprob mismatch per step "
                + ", ".join(f"{m:.1e}" for m in mismatch),
            ]
        )
    return {
        "title": "The live stack on each rollout backend (`libra run default`, SmolLM2-135M, 2 engines, CPU)",
        "command": "python -m tools.bench engine_live",
        "results": jobs | {"vllm_over_hf_trajectories_per_s": ratio},
        "rows": rows,
    }
