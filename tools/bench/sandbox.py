"""Tool-sandbox overhead: an isolated trivial Python call, cold and warm, versus plain `python -c`.

All three run the same snippet with the same interpreter in the same process and run, so the
ratios are meaningful on whatever machine runs them.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

NAME = "sandbox"
SNIPPET = "print(1)"
CALLS = 60
THROUGHPUT_CALLS = 120


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": statistics.median(ordered) * 1000,
        "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000,
        "n": len(ordered),
    }


def _plain_once(python: str) -> float:
    start = time.perf_counter()
    subprocess.run([python, "-c", SNIPPET], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


async def _timed(ex: Any) -> float:
    start = time.perf_counter()
    out = await ex.execute("python", {"code": SNIPPET})
    assert out.status == "ok", out
    return time.perf_counter() - start


async def _measure(python: str, pool_size: int, concurrency: int) -> dict[str, Any]:
    """Interleave plain, cold and warm calls so each sees the same background load."""
    from services.tool_sandbox.config import SandboxSettings
    from services.tool_sandbox.executor import SandboxExecutor

    cold = SandboxExecutor(SandboxSettings(pool_size=0, max_concurrency=concurrency))
    warm = SandboxExecutor(SandboxSettings(pool_size=pool_size, max_concurrency=concurrency))
    await cold.start()
    await warm.start()
    samples: dict[str, list[float]] = {"plain": [], "cold": [], "warm": []}
    try:
        for _ in range(CALLS):
            samples["plain"].append(_plain_once(python))
            samples["cold"].append(await _timed(cold))
            while warm.metrics()["pool"]["ready"] < pool_size:  # measure the warm path, not the refill
                await asyncio.sleep(0.002)
            await asyncio.sleep(0.03)  # let the newest warm sandbox finish interpreter start-up
            samples["warm"].append(await _timed(warm))
        rates = {}
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as threads:
            list(threads.map(lambda _: _plain_once(python), range(THROUGHPUT_CALLS)))
        rates["plain"] = THROUGHPUT_CALLS / (time.perf_counter() - start)
        for name, ex in (("cold", cold), ("warm", warm)):
            start = time.perf_counter()
            await asyncio.gather(*(_timed(ex) for _ in range(THROUGHPUT_CALLS)))
            rates[name] = THROUGHPUT_CALLS / (time.perf_counter() - start)
        pool = warm.metrics()["pool"]
    finally:
        await cold.close()
        await warm.close()
    return {name: _percentiles(values) | {"calls_per_s": rates[name]} for name, values in samples.items()} | {
        "pool": pool
    }


def run() -> dict[str, Any]:
    from services.tool_sandbox.config import SandboxSettings

    settings = SandboxSettings()
    concurrency = settings.max_concurrency
    measured = asyncio.run(
        _measure(settings.python_executable, max(settings.pool_size, concurrency), concurrency)
    )
    plain, cold, warm, pool = measured["plain"], measured["cold"], measured["warm"], measured["pool"]
    plain_rate, cold_rate, warm_rate = plain["calls_per_s"], cold["calls_per_s"], warm["calls_per_s"]
    cold_ratio = cold["p50_ms"] / plain["p50_ms"]
    warm_ratio = warm["p50_ms"] / plain["p50_ms"]

    def ms(d: dict[str, float]) -> str:
        return f"p50 {d['p50_ms']:.1f} ms / p99 {d['p99_ms']:.1f} ms"

    return {
        "title": "Tool sandbox: isolated trivial Python call vs plain subprocess",
        "command": "python -m tools.bench sandbox",
        "results": {
            "snippet": SNIPPET,
            "python": settings.python_executable,
            "concurrency": concurrency,
            "plain": plain,
            "isolated_cold": cold,
            "isolated_warm": warm | {"pool": pool},
            "cold_p50_ratio": cold_ratio,
            "warm_p50_ratio": warm_ratio,
        },
        "rows": [
            [
                "plain `python -c` latency",
                ms(plain),
                f"{CALLS} sequential calls, interleaved with the others",
            ],
            ["isolated cold start latency", ms(cold), "bwrap + namespaces + interpreter start per call"],
            ["isolated warm-pool latency", ms(warm), "sandbox started ahead of the call"],
            ["cold p50 / plain p50", f"{cold_ratio:.2f}x", "target: within 2x"],
            ["warm p50 / plain p50", f"{warm_ratio:.2f}x", ""],
            ["plain calls/s", f"{plain_rate:.1f}", f"{THROUGHPUT_CALLS} calls, {concurrency} at a time"],
            [
                "isolated cold calls/s",
                f"{cold_rate:.1f}",
                f"{THROUGHPUT_CALLS} calls, {concurrency} at a time",
            ],
            [
                "isolated warm calls/s",
                f"{warm_rate:.1f}",
                f"pool hits {pool['hits']}, misses {pool['misses']}",
            ],
        ],
    }
