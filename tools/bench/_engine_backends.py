"""Rollout engine backends side by side (part of `python -m tools.bench engine`): Libra's `hf` engine vs vLLM (its CPU build) on the same
requests, in the same run, on this machine.

Both serve SmolLM2-135M-Instruct in float32 (the dtype whose logprobs match the trainer's) with
2 threads, one backend at a time while the others idle; vLLM twice, eager (Libra's default: it
starts in ~15 s here) and compiled (`LIBRA_ROLLOUT_ENGINE_VLLM_COMPILE=1`, ~70 s to start). At each batch size B, B requests of the
same 32-token prompt family each generate exactly 128 tokens (min_new_tokens: no early EOS), all
submitted at once; tokens/s is all tokens over the wall time, the p99 turn latency is over those
B requests. Time to first token is a 1-token request alone on the engine. The batch sizes
alternate which backend goes first, so both see the same machine load.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from typing import Any

BATCHES = (1, 8, 32)
NEW_TOKENS = 128
PROMPT_TOKENS = 32
THREADS = 2
TTFT_REPEATS = 5


def _requests(n: int, tokens: int) -> list[Any]:
    from services.generation.backends.base import GenRequest

    return [
        GenRequest(
            [100 + i] + list(range(1000, 1000 + PROMPT_TOKENS - 1)),
            tokens,
            1.0,
            min_new_tokens=tokens,
            seed=i,
        )
        for i in range(n)
    ]


async def _batch(engine: Any, n: int) -> dict[str, float]:
    start = time.perf_counter()

    async def one(r: Any) -> tuple[float, int]:
        done = await engine.submit(r)
        return time.perf_counter() - start, len(done.output.token_ids)

    results = await asyncio.gather(*(one(r) for r in _requests(n, NEW_TOKENS)))
    wall = time.perf_counter() - start
    tokens = sum(k for _, k in results)
    assert tokens == n * NEW_TOKENS, "every request generates its budget"
    latencies = sorted(lat for lat, _ in results)
    return {
        "tokens_per_s": tokens / wall,
        "p99_turn_latency_s": latencies[min(len(latencies) - 1, math.ceil(0.99 * len(latencies)) - 1)],
        "wall_s": wall,
    }


async def _ttft(engine: Any) -> float:
    times = []
    for r in _requests(TTFT_REPEATS, 1):
        start = time.perf_counter()
        await engine.submit(r)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _engines() -> dict[str, tuple[Any, Any]]:
    from services.common.runconfig import EngineJob, ModelConfig, RunConfig
    from services.generation.backends.hf import HFBackend
    from services.generation.backends.vllm import VllmBackend
    from services.generation.config import EngineSettings
    from services.generation.engine import engine_for

    model = ModelConfig(source="smollm2")
    hf = HFBackend(model, torch_threads=THREADS, seed=0)
    await hf.start()
    run = RunConfig.model_validate(
        {
            "model": model.model_dump(),
            "task": {"max_new_tokens": NEW_TOKENS, "max_context_tokens": 256},
            "rollout": {"backend": "vllm", "max_batch": max(BATCHES), "torch_threads": THREADS},
        }
    )
    vllm = VllmBackend(EngineJob.of(run), EngineSettings(seed=0, vllm_dtype="float32"))
    await vllm.start()
    compiled = VllmBackend(EngineJob.of(run), EngineSettings(seed=0, vllm_dtype="float32", vllm_compile=True))
    await compiled.start()
    out = {}
    for name, backend in (("hf", hf), ("vllm", vllm), ("vllm_compiled", compiled)):
        engine = engine_for(backend, max(BATCHES))
        engine.start()
        out[name] = (backend, engine)
    return out


async def _measure() -> dict[str, Any]:
    engines = await _engines()
    measured: dict[str, Any] = {name: {} for name in engines}
    try:
        for _, engine in engines.values():  # warm-up: first calls allocate
            await _batch(engine, 2)
        for i, n in enumerate(BATCHES):
            order = list(engines) if i % 2 == 0 else list(reversed(engines))
            for name in order:
                measured[name][str(n)] = await _batch(engines[name][1], n)
        for name in reversed(engines):
            measured[name]["ttft_s"] = await _ttft(engines[name][1])
    finally:
        for backend, engine in engines.values():
            await engine.close(timeout=5)
            await backend.close()
    return measured


def run() -> tuple[dict[str, Any], list[list[str]]]:
    """The measurements (with `vllm_over_hf_tokens_per_s` by batch size) and the table's rows."""
    m = asyncio.run(_measure())

    def over_hf(name: str) -> dict[str, float]:
        return {str(n): m[name][str(n)]["tokens_per_s"] / m["hf"][str(n)]["tokens_per_s"] for n in BATCHES}

    ratio, compiled = over_hf("vllm"), over_hf("vllm_compiled")
    rows = []
    for n in BATCHES:
        h, v, c = m["hf"][str(n)], m["vllm"][str(n)], m["vllm_compiled"][str(n)]
        rows.append(
            [
                f"batch {n}: tokens/s vllm / hf (eager; compiled)",
                f"{ratio[str(n)]:.2f}x; {compiled[str(n)]:.2f}x",
                f"vllm {v['tokens_per_s']:.0f}, compiled {c['tokens_per_s']:.0f}, hf {h['tokens_per_s']:.0f} "
                f"tokens/s; p99 turn latency {v['p99_turn_latency_s']:.1f} s, {c['p99_turn_latency_s']:.1f} s, "
                f"{h['p99_turn_latency_s']:.1f} s (SmolLM2-135M, float32, {NEW_TOKENS} tokens per request)",
            ]
        )
    ttft = ", ".join(f"{name} {m[name]['ttft_s'] * 1000:.0f} ms" for name in ("vllm", "vllm_compiled", "hf"))
    rows.append(
        ["time to first token (1 request)", ttft, f"median of {TTFT_REPEATS}, a {PROMPT_TOKENS}-token prompt"]
    )
    return m | {"vllm_over_hf_tokens_per_s": ratio, "vllm_compiled_over_hf_tokens_per_s": compiled}, rows
