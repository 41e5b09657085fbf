"""The scheduler's cost per engine load report, at the scale of issue 51: the real
`InFlight.engine_load` (the lost-turn check every engine's report triggers, once a second) over
trajectories in flight spread on engines, 1,024 to 16,384 in flight and 64 to 1,024 engines.

Each report names every turn its engine holds (nothing lost), so this is the steady-state cost. The
ratio of 16,384 in flight on 1,024 engines to 1,024 on 64 (16 turns per engine in both) says
whether a report's cost grows with the whole job (a scan of every trajectory: 16x) or with its
engine's own turns only (1x).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from opentelemetry import trace

from services.common.contracts import ev
from services.common.runconfig import RunConfig
from services.policy.dispatch import Dispatcher
from services.scheduler.config import SchedulerSettings
from services.scheduler.inflight import InFlight, Live

NAME = "control_plane"
SIZES = ((1024, 64), (16384, 1024), (16384, 64))
ROUNDS = 3


def _inflight(trajectories: int, engines: int) -> tuple[InFlight, list[ev.EngineLoad]]:
    """An InFlight holding `trajectories` turns, one per trajectory, over `engines` engines, and each
    engine's report of them. Only the state `engine_load` reads is built: the trajectories carry
    no task (the report never looks at one)."""
    dispatch = Dispatcher(router=None, default_capacity=64)  # type: ignore[arg-type]  # not routed
    dispatch.set_engines({f"e{i}": "b0" for i in range(engines)})
    flight = InFlight(None, dispatch, SchedulerSettings(), RunConfig(), [], None)  # type: ignore[arg-type]
    held: dict[str, list[str]] = {f"e{i}": [] for i in range(engines)}
    now = time.monotonic()
    for t in range(trajectories):
        engine = f"e{t % engines}"
        live = Live(traj=None, span=trace.INVALID_SPAN, temperature=1.0)  # type: ignore[arg-type]
        live.request_id, live.engine_id, live.sent_at, live.seq = f"r{t}", engine, now, len(held[engine]) + 1
        flight._live[f"t{t}"] = live
        flight._by_request.add(live.request_id, f"t{t}", engine)
        held[engine].append(live.request_id)
    reports = [
        ev.EngineLoad(engine_id=e, capacity_seqs=64, request_ids=ids, last_seq=len(ids))
        for e, ids in held.items()
    ]
    return flight, reports


def _per_report_us(trajectories: int, engines: int) -> float:
    flight, reports = _inflight(trajectories, engines)

    async def go() -> float:
        rounds = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for load in reports:
                await flight.engine_load(load)
            rounds.append((time.perf_counter() - start) / len(reports))
        return min(rounds) * 1e6

    return asyncio.run(go())


def run() -> dict[str, Any]:
    us = {(t, e): _per_report_us(t, e) for t, e in SIZES}
    rows = [
        [
            f"one load report, {t:,} in flight on {e:,} engines",
            f"{us[(t, e)]:.1f} µs",
            f"{t // e} turns per engine",
        ]
        for t, e in SIZES
    ]
    rows.append(
        [
            "16,384 in flight on 1,024 engines / 1,024 on 64",
            f"{us[(16384, 1024)] / us[(1024, 64)]:.2f}x",
            "16 turns per engine in both: 16x if a report scanned the job (the scan before the per-engine "
            "index, measured the same way on 2026-11-27: 124 and 1,389 us, 11x); above 1x: a larger working set",
        ]
    )
    per_s = us[(16384, 1024)] * 1024 / 1e6
    rows.append(["1,024 engines reporting every second", f"{per_s:.3f} CPU-s/s", "at 16,384 in flight"])
    return {
        "title": "Scheduler cost per engine load report (issue 51)",
        "command": "python -m tools.bench control_plane",
        "rows": rows,
        "results": {f"{t}x{e}": round(us[(t, e)], 2) for t, e in SIZES},
        "median_us": statistics.median(us.values()),
    }
