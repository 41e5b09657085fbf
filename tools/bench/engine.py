"""Rollout engine: continuous batching vs static batching on a long-tailed request mix, then the
`vllm` backend vs the `hf` engine on the same requests (`_engine_backends.py`).

The same hf backend (the tiny random Llama, CPU) serves the same requests twice per round, once
under the continuous batcher and once with admission only into an empty batch (static batching,
what the engine did before: a batch runs until its longest row ends). Every fourth request is
long (256 tokens), the rest short (24 tokens), all submitted at once, 8 rows at a time; EOS is
masked off so every request generates exactly its budget and both modes do the same work. Rounds
alternate the order, so both see the same machine load.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

NAME = "engine"
REQUESTS = 32
LONG, SHORT = 256, 24
MAX_BATCH = 8
ROUNDS = 2


async def _serve(backend: Any, static: bool) -> dict[str, float]:
    from services.generation.backends.base import GenRequest
    from services.generation.engine import ContinuousEngine

    engine = ContinuousEngine(backend, MAX_BATCH, static_batches=static)
    engine.start()
    reqs = [GenRequest([100 + i, 7, 8, 9], LONG if i % 4 == 0 else SHORT, 1.0) for i in range(REQUESTS)]
    start = time.perf_counter()

    async def one(r: GenRequest) -> tuple[float, int]:
        done = await engine.submit(r)
        return time.perf_counter() - start, len(done.output.token_ids)

    results = await asyncio.gather(*(one(r) for r in reqs))
    wall = time.perf_counter() - start
    await engine.close(timeout=5)
    latencies = [lat for lat, _ in results]
    short = [lat for (lat, _), r in zip(results, reqs, strict=True) if r.max_new_tokens == SHORT]
    tokens = sum(n for _, n in results)
    assert tokens == sum(r.max_new_tokens for r in reqs), "every request generates its budget"
    return {
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "mean_latency_s": statistics.mean(latencies),
        "short_mean_latency_s": statistics.mean(short),
        "iterations": float(engine.iterations),
    }


async def _measure() -> dict[str, list[dict[str, float]]]:
    import torch

    from services.common.runconfig import ModelConfig
    from services.generation.backends.hf import HFBackend

    backend = HFBackend(ModelConfig(source="tiny-random"), torch_threads=2, seed=0)
    await backend.start()
    head = backend.model.get_output_embeddings()
    bias = torch.zeros(backend.vocab_size)
    bias[sorted(backend.eos)] = -1e9  # no early stop: both modes generate exactly the budgets
    head.bias = torch.nn.Parameter(bias)
    out: dict[str, list[dict[str, float]]] = {"continuous": [], "static": []}
    for i in range(ROUNDS):
        order = ["continuous", "static"] if i % 2 == 0 else ["static", "continuous"]
        for mode in order:
            out[mode].append(await _serve(backend, static=mode == "static"))
    return out


def run() -> dict[str, Any]:
    from tools.bench import _engine_backends

    measured = asyncio.run(_measure())
    backends, backend_rows = _engine_backends.run()

    def mean(mode: str, key: str) -> float:
        return statistics.mean(r[key] for r in measured[mode])

    tput = mean("continuous", "tokens_per_s") / mean("static", "tokens_per_s")
    lat = mean("static", "mean_latency_s") / mean("continuous", "mean_latency_s")
    short = mean("static", "short_mean_latency_s") / mean("continuous", "short_mean_latency_s")
    mix = f"{REQUESTS} requests, 1 in 4 of {LONG} tokens, else {SHORT}; batch {MAX_BATCH}; {ROUNDS} rounds"
    return {
        "title": "Rollout engine: continuous vs static batching (hf, tiny random Llama), vllm vs hf (CPU)",
        "command": "python -m tools.bench engine",
        "results": measured
        | {"throughput_ratio": tput, "mean_latency_ratio": lat, "short_latency_ratio": short}
        | {"backends": backends, "vllm_over_hf_tokens_per_s": backends["vllm_over_hf_tokens_per_s"]},
        "rows": [
            [
                "continuous tokens/s",
                f"{mean('continuous', 'tokens_per_s'):.0f}",
                f"{mean('continuous', 'iterations'):.0f} iterations; {mix}",
            ],
            [
                "static tokens/s",
                f"{mean('static', 'tokens_per_s'):.0f}",
                f"{mean('static', 'iterations'):.0f} iterations",
            ],
            ["throughput: continuous / static", f"{tput:.2f}x", "same requests, same backend, same run"],
            ["mean request latency: static / continuous", f"{lat:.2f}x", ""],
            ["short-request latency: static / continuous", f"{short:.2f}x", "requests of 24 tokens"],
            *backend_rows,
        ],
    }
