"""The live stack on each rollout backend: one `libra run` of the default job (SmolLM2-135M, two
engines, the CPU trainer, the embedded NATS and Redis) with `rollout.backend: hf`, then with
`vllm`, on this machine, in the same run of the benchmark.

What it reports per backend: the job's wall time and trajectories/s (from its report), whether
the job lost or trained twice any trajectory, and the least memory the machine had available
while it ran (sampled from /proc/meminfo every second): two vLLM engines and the trainer must
fit beside each other without swapping.

And the stack's efficiency on vLLM: the tokens the live job's engines generated per second of the
job, over the tokens per second one vLLM engine generates offline for the same turns on the same
machine with nothing else running. The turns are the job's own (each engine's `engine.generate`
span: its context and new tokens), replayed after the job as requests of random token ids of the
same lengths that generate exactly as many tokens, all submitted at once to an engine with room
for as many as the job's engines together. The ratio is what the control plane, the trainer
beside the engines, tool calls and turn-by-turn agent loops cost the engines' throughput.
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

from services.generation.backends.vllm import host_memory

NAME = "engine_live"
CONFIG = "default"
BACKENDS = ("hf", "vllm")
TIMEOUT_S = 1500


def _available_mib() -> float:
    return host_memory()[1] / 2**20


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
        "turns": _turns(out / run_id / "traces"),
        "tokens_generated": sum(e.get("tokens_generated", 0) for e in report["engines"]),
        "prefix_cache_hit_rate": [e.get("prefix_cache_hit_rate") for e in report["engines"]],
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


def _turns(traces: Path) -> list[tuple[int, int]]:
    """(context tokens, new tokens) of every turn the job's engines generated, from their spans."""
    from tools.trace_view import read_spans

    return [
        (int(s.attributes["libra.context_tokens"]), int(s.attributes["libra.new_tokens"]))
        for s in read_spans(traces)
        if s.name == "engine.generate" and "libra.new_tokens" in s.attributes
    ]


def offline_tokens_per_s(
    turns: list[tuple[int, int]], concurrency: int, threads: int = 2
) -> dict[str, float]:
    """One vLLM engine (float32, eager, `threads` threads) generating `turns` alone: random
    prompts of each turn's context length, each producing exactly its new tokens, all submitted
    at once to an engine that runs up to `concurrency` of them together."""
    import asyncio
    import random

    from services.common.runconfig import EngineJob, ModelConfig, RunConfig
    from services.generation.backends.base import GenRequest
    from services.generation.backends.vllm import VllmBackend
    from services.generation.config import EngineSettings
    from services.generation.engine import engine_for

    rng = random.Random(0)
    requests = [
        GenRequest([rng.randrange(1000, 40000) for _ in range(max(1, c))], n, 1.0, min_new_tokens=n, seed=i)
        for i, (c, n) in enumerate(turns)
        if n > 0
    ]
    longest = max(c + n for c, n in turns)

    async def measure() -> dict[str, float]:
        run = RunConfig.model_validate(
            {
                "model": ModelConfig(source="smollm2").model_dump(),
                "task": {"max_new_tokens": max(n for _, n in turns), "max_context_tokens": longest + 16},
                "rollout": {"backend": "vllm", "max_batch": concurrency, "torch_threads": threads},
            }
        )
        backend = VllmBackend(EngineJob.of(run), EngineSettings(seed=0, vllm_dtype="float32"))
        await backend.start()
        engine = engine_for(backend, concurrency)
        engine.start()
        try:
            await asyncio.gather(*(engine.submit(r) for r in requests[:concurrency]))  # warm-up
            start = time.perf_counter()
            done = await asyncio.gather(*(engine.submit(r) for r in requests))
            wall = time.perf_counter() - start
        finally:
            await engine.close(timeout=5)
            await backend.close()
        tokens = sum(len(d.output.token_ids) for d in done)
        return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "requests": len(requests)}

    return asyncio.run(measure())


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
    from services.common.runconfig import load_run_config
    from tools.stack import ROOT

    cfg = load_run_config(ROOT / "configs" / f"{CONFIG}.yaml")
    offline = offline_tokens_per_s(vllm["turns"], cfg.rollout.max_batch * cfg.rollout.engines)
    live_tokens_per_s = vllm["tokens_generated"] / vllm["wall_s"]
    efficiency = live_tokens_per_s / offline["tokens_per_s"]
    rows = [
        [
            f"`libra run {CONFIG}`: trajectories/s vllm / hf",
            f"{ratio:.2f}x",
            f"vllm {vllm['trajectories_per_s']:.3f} ({vllm['wall_s']:.0f} s), "
            f"hf {hf['trajectories_per_s']:.3f} ({hf['wall_s']:.0f} s); one job each, engines eager, float32",
        ]
    ]
    rows.append(
        [
            "stack efficiency on vllm: live tokens/s ÷ offline vLLM tokens/s, same turns",
            f"{efficiency:.2f}",
            f"live {live_tokens_per_s:.0f} tokens/s ({vllm['tokens_generated']} tokens by 2 engines in "
            f"{vllm['wall_s']:.0f} s, beside the trainer); offline {offline['tokens_per_s']:.0f} tokens/s "
            f"(the job's {offline['requests']} turns replayed on one engine, nothing else running)",
        ]
    )
    for name, j in jobs.items():
        mismatch = [m for m in j["logprob_mismatch_per_step"] if m is not None]
        rows.append(
            [
                f"{name}: lost / trained twice / engines on the final version",
                f"{j['lost']} / {j['trained_twice']} / {j['all_engines_on_final_version']}",
                f"least memory available {j['min_available_mib'] / 1024:.1f} GiB (swap "
                f"{j['swap_total_mib']:.0f} MiB); logprob mismatch per step "
                + ", ".join(f"{m:.1e}" for m in mismatch)
                + "; prefix-cache hit rate by engine "
                + ", ".join("n/a" if h is None else f"{h:.2f}" for h in j["prefix_cache_hit_rate"]),
            ]
        )
    return {
        "title": "The live stack on each rollout backend (`libra run default`, SmolLM2-135M, 2 engines, CPU)",
        "command": "python -m tools.bench engine_live",
        "results": {name: {k: v for k, v in j.items() if k != "turns"} for name, j in jobs.items()}
        | {
            "vllm_over_hf_trajectories_per_s": ratio,
            "stack_efficiency": {
                "live_tokens_per_s": live_tokens_per_s,
                "offline": offline,
                "ratio": efficiency,
            },
        },
        "rows": rows,
    }
