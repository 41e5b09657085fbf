"""The scheduler's control-plane costs at the scale of issue 51.

- Per engine load report: the real `Roster.engine_load` (the lost-turn check every engine's
  report triggers, once a second) over trajectories in flight spread on engines, 1,024 to 16,384
  in flight and 64 to 1,024 engines. Each report names every turn its engine holds (nothing lost),
  so this is the steady-state cost. The ratio of 16,384 in flight on 1,024 engines to 1,024 on 64
  (16 turns per engine in both) says whether a report's cost grows with the whole job (a scan of
  every trajectory: 16x) or with its engine's own turns only (1x).
- Per trajectory: the bytes of its turn requests (`ev.TurnRequest` as the scheduler builds them)
  carrying the whole context each turn, against context deltas (only what the engine does not
  hold yet, services/common/held_context.py), at 8 and 32 turns.
- Per placement: the real `Dispatcher.place` of a turn (C-MLFQ, one bucket of 64 to 4,096 engines
  each running a random share of its slots, a third of the turns going back to the engine holding
  their context), against `ScanningDispatcher`, the placement before the load indexes (every
  engine shown to the policy), in the same run; both decide the same engines
  (tests/unit/test_placement.py).
- Per trajectory launched: the real `SyntheticEpisode.members` of `r2e_gym` groups of 8 (what a
  scheduler runs for every group it starts, and for every group it re-issues after taking over),
  against drawing each member's prompt tokens itself (the launch before the group's samples shared
  one drawing), in the same run.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

from opentelemetry import trace

from services.common.contracts import ev
from services.common.held_context import Held
from services.common.runconfig import BucketConfig, RunConfig
from services.policy.dispatch import Dispatcher, build_dispatcher, kv_view
from services.scheduler.config import SchedulerSettings
from services.scheduler.episodes import Member, SyntheticEpisode
from services.scheduler.feed import GroupTicket
from services.scheduler.inflight import InFlight, Live
from services.scheduler.roster import Roster
from services.scheduler.task import Task

NAME = "control_plane"
SIZES = ((1024, 64), (16384, 1024), (16384, 64))
ROUNDS = 3


def _inflight(trajectories: int, engines: int) -> tuple[Roster, list[ev.EngineLoad]]:
    """The roster of an InFlight holding `trajectories` turns, one per trajectory, over `engines` engines, and each
    engine's report of them. Only the state `engine_load` reads is built: the trajectories carry
    no task (the report never looks at one)."""
    dispatch = Dispatcher(router=None, default_capacity=64)  # type: ignore[arg-type]  # not routed
    dispatch.set_engines({f"e{i}": "b0" for i in range(engines)})
    cfg = RunConfig()
    flight = InFlight(None, dispatch, SchedulerSettings(), cfg.rollout, cfg.task, [], None)  # type: ignore[arg-type]
    held: dict[str, list[str]] = {f"e{i}": [] for i in range(engines)}
    now = time.monotonic()
    for t in range(trajectories):
        engine = f"e{t % engines}"
        live = Live(traj=None, span=trace.INVALID_SPAN, temperature=1.0)  # type: ignore[arg-type]
        live.request_id, live.engine_id, live.sent_at, live.seq = f"r{t}", engine, now, len(held[engine]) + 1
        flight._live[f"t{t}"] = live
        flight.requests.add(live.request_id, f"t{t}", engine)
        held[engine].append(live.request_id)
    reports = [
        ev.EngineLoad(engine_id=e, capacity_seqs=64, request_ids=ids, last_seq=len(ids))
        for e, ids in held.items()
    ]
    return Roster(flight, SchedulerSettings()), reports


def _per_report_us(trajectories: int, engines: int) -> float:
    roster, reports = _inflight(trajectories, engines)

    async def go() -> float:
        rounds = []
        for _ in range(ROUNDS):
            start = time.perf_counter()
            for load in reports:
                await roster.engine_load(load)
            rounds.append((time.perf_counter() - start) / len(reports))
        return min(rounds) * 1e6

    return asyncio.run(go())


PLACEMENT_ENGINES = (64, 1024, 4096)
PLACEMENTS = 2000


class ScanningDispatcher(Dispatcher):
    """Placement as it was before the load indexes: every engine of the bucket (or of the stack,
    where the bucket has none), less the avoided one while another could serve, shown to the
    policy. The baseline of this benchmark, and the reference the indexed placement is tested
    against."""

    def _pick(
        self, traj_id: str, bucket: str, avoid: str | None, need_tokens: int, seqs: int = 1
    ) -> str | None:
        members = [e for e in self.engines.values() if e.bucket == bucket] or list(self.engines.values())
        if avoid is not None and any(e.engine_id != avoid for e in self.engines.values()):
            members = [e for e in members if e.engine_id != avoid] or [
                e for e in self.engines.values() if e.engine_id != avoid
            ]
        views = [kv_view(e.engine_id, e.in_flight, e.capacity, e.free_kv, need_tokens, seqs) for e in members]
        return self.router.pick_engine(bucket, views, traj_id) if views else None


def _placement_us(engines: int, scanning: bool) -> float:
    """Mean µs of one `place` (the slot taken, then freed) on `engines` engines of one bucket."""
    made = build_dispatcher([BucketConfig(name="all", tensor_parallel=1)], "cmlfq", 16)
    d = ScanningDispatcher(made.router, 16) if scanning else made
    d.set_engines({f"e{i}": "all" for i in range(engines)})
    rng = random.Random(0)
    for i in range(engines):  # a random share of each engine's slots taken
        for _ in range(rng.randint(0, 15)):
            d._take(d.engines[f"e{i}"], 0)
    trajs = [f"t{i}" for i in range(PLACEMENTS)]
    for i, traj in enumerate(trajs):
        d.admit(traj, f"p{i % 64}", 0.0)
        if i % 3 == 0:  # its last turn ran on some engine: the policy pulls it back there
            d.router.moved(traj, f"e{rng.randrange(engines)}")
    start = time.perf_counter()
    for traj in trajs:
        engine = d.place(traj, 1.0, None, 256)
        if engine is not None:
            d.release(engine)
    return (time.perf_counter() - start) / len(trajs) * 1e6


TURN_SHAPES = (8, 32)
PROMPT_TOKENS, GENERATED_TOKENS, TOOL_TOKENS = 1000, 256, 256


def _turn_request_bytes(turns: int, deltas: bool) -> int:
    """Bytes of one trajectory's turn requests: a prompt, then each turn's generated tokens and
    a tool return, every turn on the engine that served the one before."""
    rng = random.Random(turns)
    context = [rng.randrange(49152) for _ in range(PROMPT_TOKENS)]
    held: Held | None = None
    total = 0
    for _ in range(turns):
        offset = held.offset_for("e0", context) if deltas and held is not None else 0
        req = ev.TurnRequest(
            request_id="r" * 32, trajectory_id="g00001-tasks-1-s3", engine_id="e0", bucket="short",
            context_token_ids=context[offset:], context_offset=offset,
            context_digest=held.digest if held is not None and offset else 0, max_new_tokens=GENERATED_TOKENS,
        )  # fmt: skip
        total += req.ByteSize()
        generated = [rng.randrange(49152) for _ in range(GENERATED_TOKENS)]
        held = Held.after("e0", context, generated)
        context = [*context, *generated, *(rng.randrange(49152) for _ in range(TOOL_TOKENS))]
    return total


LAUNCH_GROUPS = 32
LAUNCH_GROUP_SIZE = 8


def _launch_us(each_draws: bool) -> float:
    """µs per trajectory to build an `r2e_gym` group's members; `each_draws`: every member draws
    its own prompt tokens (the launch before)."""
    cfg = RunConfig.model_validate(
        {
            "task": {  # as `libra bench live --workload r2e_gym` runs it
                "dataset": "synthetic",
                "workload": "r2e_gym",
                "group_size": LAUNCH_GROUP_SIZE,
                "max_context_tokens": 40960,  # r2e_gym sets no window: bench live's default
            },
            "rollout": {"backend": "emulated"},
            "training": {"backend": "emulated"},
        }
    )
    episode = SyntheticEpisode(None, cfg.task, cfg.rollout.emulated.time_scale)  # type: ignore[arg-type]  # a synthetic group needs no tokenizer
    task = episode.synthetic
    tickets = [GroupTicket(f"g{i}", Task(f"p{i}", "", 0), i) for i in range(LAUNCH_GROUPS)]
    start = time.perf_counter()
    for ticket in tickets:
        if each_draws:
            specs = task.group(ticket, 0)[:LAUNCH_GROUP_SIZE]
            [Member(task.prompt_ids(s), task.script(s)) for s in specs]
        else:
            episode.members(ticket, 0, LAUNCH_GROUP_SIZE)
    return (time.perf_counter() - start) / (LAUNCH_GROUPS * LAUNCH_GROUP_SIZE) * 1e6


def run() -> dict[str, Any]:
    us = {(t, e): _per_report_us(t, e) for t, e in SIZES}
    turn_bytes = {(n, d): _turn_request_bytes(n, d) for n in TURN_SHAPES for d in (False, True)}
    place = {
        (n, scanning): min(_placement_us(n, scanning) for _ in range(ROUNDS))
        for n in PLACEMENT_ENGINES
        for scanning in (False, True)
    }
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
    for n in TURN_SHAPES:
        whole, delta = turn_bytes[(n, False)], turn_bytes[(n, True)]
        rows.append(
            [
                f"turn requests of a {n}-turn trajectory on one engine",
                f"{delta / 1024:,.0f} KiB",
                f"whole context every turn: {whole / 1024:,.0f} KiB ({whole / delta:.1f}x); prompt "
                f"{PROMPT_TOKENS:,}, {GENERATED_TOKENS} generated and {TOOL_TOKENS} tool tokens a turn",
            ]
        )
    for n in PLACEMENT_ENGINES:
        indexed, scanned = place[(n, False)], place[(n, True)]
        rows.append(
            [
                f"one placement, {n:,} engines in the bucket",
                f"{indexed:.1f} µs",
                f"scanning every engine: {scanned:.1f} µs ({scanned / indexed:.1f}x); C-MLFQ, the same engines chosen",
            ]
        )
    launch = {each: min(_launch_us(each) for _ in range(ROUNDS)) for each in (False, True)}
    rows.append(
        [
            f"one trajectory launched, r2e_gym groups of {LAUNCH_GROUP_SIZE}",
            f"{launch[False]:.0f} µs",
            f"each sample drawing its own prompt: {launch[True]:.0f} µs ({launch[True] / launch[False]:.1f}x); "
            "5,464 a step at 1,024 engines, 512 re-issued by a scheduler taking over",
        ]
    )
    growth = place[(PLACEMENT_ENGINES[-1], False)] / place[(PLACEMENT_ENGINES[0], False)]
    rows.append(
        [
            f"placement at {PLACEMENT_ENGINES[-1]:,} engines / at {PLACEMENT_ENGINES[0]:,}",
            f"{growth:.2f}x",
            f"indexed (O(log n)); a scan grows {PLACEMENT_ENGINES[-1] // PLACEMENT_ENGINES[0]}x with the engines",
        ]
    )
    return {
        "title": "Scheduler cost per engine load report, per placement, and turn bytes (issue 51)",
        "command": "python -m tools.bench control_plane",
        "rows": rows,
        "results": {f"{t}x{e}": round(us[(t, e)], 2) for t, e in SIZES},
        "turn_request_bytes": {f"{n}{'-delta' if d else ''}": v for (n, d), v in turn_bytes.items()},
        "placement_us": {
            f"{n}{'-scan' if scanning else ''}": round(v, 2) for (n, scanning), v in place.items()
        },
        "launch_us_per_trajectory": {"shared": round(launch[False], 1), "each_draws": round(launch[True], 1)},
        "median_us": statistics.median(us.values()),
    }
