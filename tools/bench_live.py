"""`libra bench live`: does the simulator predict the live stack?

Starts the real stack (nats-server, Redis, the five services, N emulated engines in the plan's
buckets), runs a simulator workload on it (`task.dataset: synthetic`) with Libra's policy
(C-MLFQ) and with plain least-loaded on the same engines, one job after the other, then runs the
simulator on the same configuration (same buckets and TPs, same routers, same batch size,
staleness, steps and emulated training GPUs) over several seeds, and writes `DIR/live.json`:
per policy, measured and predicted trajectories/s and p50/p99 trajectory latency, migrations and
the relative errors; and the scheduler's control-plane cost (decisions/s, decision latency,
NATS messages/s).

By default everything is EMULATED: engines time their iterations with the cost model and the
trainer its steps; only the control plane (bus, scheduler, sandbox, weight sync, fencing) is real.
Measured times are converted to emulated seconds (wall / time_scale), the simulator's unit.

With `--backend vllm --profile PROFILE` the engines are real vLLM engines serving the model the
profile was measured on (`libra calibrate --backend vllm`), in real time (time_scale 1), and the
simulator predicts them from the same profile: the fidelity of the calibrated simulator against
real engines. Training stays emulated (priced from the profile), unless `--trainer torch`: the
real trainer, whose steps the simulator prices from the profile's training fit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from services.common import subjects
from services.common.bus import Bus, close_nats
from services.common.contracts import ev
from services.common.membership import SCHEDULER_ROLE
from services.common.ownership import OwnershipStore
from services.common.runconfig import RunConfig
from services.common.synthetic import Workload
from services.simulation.live import job_gpus, simulate
from services.simulation.runner import percentile, steady_rate
from tools import host_cpu
from tools.engine_iterations import STALL
from tools.layout import choose_layout, summary
from tools.runner import run_job
from tools.sim.stats import mean_ci
from tools.stack import Stack

POLICIES = {
    "libra": "cmlfq",
    "least_loaded": "least_loaded",
    "libra_lend": "cmlfq",
    "libra_lend_always": "cmlfq",
    "libra_planned": "cmlfq",
    "libra_refit": "cmlfq",
    "libra_relayout": "cmlfq",
}
LENDING = {"libra_lend": "predictive", "libra_lend_always": "always"}
"""Policies whose trainer lends its GPUs to rollout while it waits for its batch, and when
(`planner.lending.policy`): as the forecast says, or at every wait."""
REPLANNED = {"libra_refit": False, "libra_relayout": True}
"""Policies whose planner re-plans while the job runs: the thresholds (`planner.replan`), and with
`True` the engines' layout over the buckets too (`planner.relayout`), every `--replan-interval-s`."""
PLANNED = "libra_planned"
"""The policy whose layout (split, buckets and their TP and engines, lending) the simulator's
planner chooses from the workload on the same GPUs (`planner.layout.search`, tools/layout.py)."""
TARGETS = {"throughput_error": 0.05, "p99_error": 0.10, "lending_gain": 0.05, "lending_gain_error": 0.05}
"""Errors are relative to the prediction; lending's gain (libra_lend over libra, measured) at
least +5 %, and within 5 points of the simulator's predicted gain."""


def lent_engines(ns: argparse.Namespace) -> int:
    """Engines of `--lend-tp` GPUs on the training GPUs (the simulator's `lend_tp` fleet)."""
    if ns.lend_tp < 1 or ns.train_gpus % ns.lend_tp:
        raise ValueError(f"{ns.train_gpus} training GPUs cannot lend TP{ns.lend_tp} engines")
    return ns.train_gpus // ns.lend_tp


def live_config(
    ns: argparse.Namespace,
    workload: Workload,
    policy: str,
    lend: str | None = None,
    relayout: bool | None = None,
) -> dict[str, Any]:
    """The job: the workload on `engines` emulated engines in two buckets, emulated training
    (lending its GPUs to rollout while it waits for its batch under the `lend` policy, if any),
    the buckets fixed, or re-planned live (`relayout` not None: thresholds, and with True the
    engines' layout)."""
    real = ns.backend != "emulated"
    short_limit = ns.short_bucket_tokens or _median_output(workload)
    planner: dict[str, Any] = {"replan": False}  # the simulated configuration keeps its buckets too
    if relayout is not None:
        interval = getattr(ns, "replan_interval_s", 20.0)
        planner = {
            "replan": True,
            "relayout": relayout,
            "interval_s": interval,
            "cooldown_s": interval / 2,
            "min_samples": 16,
        }
    if lend:
        planner["lending"] = {
            "engines": lent_engines(ns),
            "tensor_parallel": ns.lend_tp,
            "policy": lend,
        }
    context = workload.max_context if workload.max_context < 1 << 62 else 40960
    if real:  # the engines' model: the one the profile measured, within its window
        context = min(context, _profiled(ns)["model"]["max_context"])
    return {
        "name": f"bench-live-{policy}" + (f"-lend-{lend}" if lend else ""),
        "model": {"source": _profiled(ns)["measured"]["model"] if real else "tiny-random"},
        "task": {
            "dataset": "synthetic",
            "workload": str(Path(ns.workload).resolve()) if Path(ns.workload).is_file() else ns.workload,
            "num_prompts": 10_000,
            "seed": ns.seed,
            "group_size": ns.group_size,
            # a real engine sizes its KV cache and longest sequence by these: no more than asked
            "max_new_tokens": min(workload.max_new, context) if real else 32768,
            "max_context_tokens": context,
            "tool_timeout_s": 300,
        },
        "rollout": {
            "engines": ns.engines,
            "backend": ns.backend,
            "buckets": [
                {"name": "short", "tensor_parallel": 1, "max_output_tokens": short_limit},
                {"name": "long", "tensor_parallel": ns.long_tp},
            ],
            "policy": policy,
            "max_batch": ns.max_batch,
            "emulated": {
                "gpu": ns.gpu,
                "model": ns.model,
                "time_scale": ns.time_scale,
                **({"profile": str(ns.profile.resolve())} if ns.profile else {}),
            },
        },
        "training": {
            "backend": ns.trainer,
            "steps": ns.steps,
            "groups_per_step": ns.groups_per_step,
            "max_staleness": ns.staleness,
            # a real trainer is one device here: the simulator prices its steps on one
            "emulated_gpus": ns.train_gpus if ns.trainer == "emulated" else 1,
            "emulated_tp": ns.train_tp if ns.trainer == "emulated" else 1,
            "micro_batch": 64 if ns.trainer == "emulated" else 4,
            "torch_threads": 1,
        },
        "job": {
            "stall_timeout_s": 600,
            **({"lease_ttl_s": ns.lease_ttl_s} if getattr(ns, "lease_ttl_s", None) else {}),
        },
        "planner": planner,
    }


@functools.cache
def _read_profile(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or "measured" not in data or "model" not in data:
        raise ValueError(f"{path}: not a `libra calibrate` profile (no measured/model sections)")
    return data


def _profiled(ns: argparse.Namespace) -> dict[str, Any]:
    """The profile the real engines were measured in: their model source and its window."""
    return _read_profile(ns.profile.resolve())


def settle(ns: argparse.Namespace) -> None:
    """Defaults that depend on the backend, and what real engines cannot do: they run in real time
    (time_scale 1), on one device each (TP1), serving the model their profile measured."""
    real = ns.backend != "emulated"
    if ns.engines is None:
        ns.engines = 2 if real else 16
    if ns.time_scale is None:
        ns.time_scale = 1.0 if real else 0.12
    if ns.long_tp is None:
        ns.long_tp = 1 if real else 2
    if ns.engines_per_host < 1:
        raise ValueError("--engines-per-host must be at least 1")
    if real and ns.engines_per_host > 1:
        raise ValueError(
            "--engines-per-host: a host serves emulated engines only (a real one has a device of its own)"
        )
    if not real:
        if ns.trainer != "emulated":
            raise ValueError("--trainer torch needs real engines (--backend vllm|hf)")
        return
    if ns.profile is None:
        raise ValueError(
            f"--backend {ns.backend} needs --profile: the engines' own `libra calibrate --backend "
            f"{ns.backend}` profile, which the simulator predicts them from"
        )
    measured = _profiled(ns)["measured"]
    if measured.get("backend") != ns.backend:
        raise ValueError(
            f"{ns.profile} measured the {measured.get('backend')!r} engine, not {ns.backend!r}: "
            f"calibrate the engine you run (libra calibrate --backend {ns.backend})"
        )
    if ns.time_scale != 1.0:
        raise ValueError("real engines run in real time: --time-scale must be 1")
    if ns.long_tp != 1:
        raise ValueError("real engines here run on one device each: --long-tp must be 1")


def _median_output(workload: Workload) -> int:
    import random

    rng = random.Random(0)
    outs = [s.output_tokens for g in range(64) for s in workload.sample_group(rng, f"q{g}", 0)]
    return max(1, int(statistics.median(outs)))


@dataclass
class Watch:
    """Completed trajectories and train steps of one job, as they go by on the bus."""

    latencies: list[float] = field(default_factory=list)
    breakdowns: list[ev.LatencyBreakdown] = field(default_factory=list)
    failed: int = 0
    step_ends: dict[int, float] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)
    kill_at_step: int = 0
    """Kill -9 the (active) scheduler once this step is committed (0: no fault)."""
    killed_at: float | None = None
    """Wall time of that kill."""
    recovered_s: float | None = None
    """From the kill to the first trajectory a scheduler completed after it: the job back in service."""
    dispatching_s: float | None = None
    """From the kill to the first turn a scheduler sent an engine after it: the takeover alone (the
    first completed trajectory also waits for that trajectory's own turns)."""
    killed: str = ""
    """Which scheduler was killed (the one acting then)."""


async def _acting_scheduler(stack: Stack, run_id: str) -> str:
    """The scheduler holding the job's role lease: the first to register acts, which may be a
    standby (`scheduler-standby-<i>`) as well as `scheduler`."""
    auth = stack.redis_auth()
    store = OwnershipStore.from_url(
        stack.redis_url, run_id, auth.get("password"), stack.tls, username=auth.get("username")
    )
    try:
        held = await store.holder(SCHEDULER_ROLE)
    finally:
        await store.close()
    return held.owner if held is not None else "scheduler"


async def _first_turn_after(bus: Bus, watch: Watch) -> None:
    """Times the first turn request any scheduler sends once `watch.killed_at` is set (only
    schedulers send them, and the killed one sends nothing more); undecoded, and unsubscribed at
    once: at a thousand engines the turns are most of the bus's messages."""
    killed_at = watch.killed_at
    assert killed_at is not None

    async def on_turn(msg: Any) -> None:
        if watch.dispatching_s is None:
            watch.dispatching_s = time.time() - killed_at
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    sub = await bus.nc.subscribe(bus.subject(f"{subjects.TURN_REQUEST}.>"), cb=on_turn)


def _watch(stack: Stack, run_id: str, watch: Watch) -> threading.Thread:
    async def go() -> None:
        bus = await Bus.connect(stack.nats_url, run_id, "cli", "bench-live", stack.nats_auth("cli"))

        async def on_traj(m: ev.CompletedTrajectory, _: Any) -> None:
            if watch.killed_at is not None and watch.recovered_s is None and m.completed_at > watch.killed_at:
                watch.recovered_s = m.completed_at - watch.killed_at
            if m.failure.code:
                watch.failed += 1
            else:
                watch.latencies.append(m.latency_s)
                watch.breakdowns.append(m.breakdown)

        async def on_step(m: ev.TrainMetrics, _: Any) -> None:
            if m.step > 0 and m.step not in watch.step_ends:
                watch.step_ends[m.step] = time.monotonic()
            if watch.kill_at_step and m.step >= watch.kill_at_step and watch.killed_at is None:
                acting = await _acting_scheduler(stack, run_id)
                proc = stack.procs.get(acting)
                if proc is not None and proc.poll() is None:
                    proc.kill()  # the supervisor restarts it; a standby may take the role first
                    watch.killed_at, watch.killed = time.time(), acting
                    await _first_turn_after(bus, watch)
                    print(
                        f"bench live: killed {acting}, the acting scheduler (-9), after step {m.step}",
                        flush=True,
                    )

        await bus.subscribe(subjects.TRAJ_COMPLETED, ev.CompletedTrajectory, on_traj)
        await bus.subscribe(subjects.TRAIN_METRICS, ev.TrainMetrics, on_step)
        try:
            while not watch.stop.is_set():
                await asyncio.sleep(0.2)
        finally:
            await bus.close()
            await close_nats(bus.nc)

    t = threading.Thread(target=lambda: asyncio.run(go()), daemon=True)
    t.start()
    return t


def measured(watch: Watch, report: dict[str, Any], cfg: RunConfig) -> dict[str, Any]:
    """Emulated-time figures of a live job, defined as for the simulated one (`steady_rate`:
    trained trajectories per second from the first step's end to the end of the step before the
    last, the job's drain; latency quantiles by the simulator's own `percentile`)."""
    scale = cfg.rollout.emulated.time_scale
    ends = [watch.step_ends[s] / scale for s in sorted(watch.step_ends)]
    steady = steady_rate(ends, cfg.trajectories_per_step, drained=True)
    lat = [x / scale for x in watch.latencies]
    sched = report.get("scheduler", {})
    wall = float(report.get("wall_s") or 0.0) or 1e-9
    return {
        "trajectories_per_s": steady,
        "latency_p50_s": percentile(lat, 0.5),
        "latency_p99_s": percentile(lat, 0.99),
        "latency_breakdown_mean_s": _breakdown(watch, scale),
        "trajectories": len(lat),
        "failed": watch.failed,
        "steps_seen": len(ends),
        "train_step_s": [float(x) / scale for x in report.get("step_s") or []],
        "push_s": [float(p["seconds"]) / scale for p in report.get("weight_push") or []],
        "migrations": report.get("migrations", 0),
        "lending": _lending(report.get("lending"), scale),
        "status": report.get("status"),
        "wall_s": wall,
        "decisions_per_s": sched.get("decisions", 0) / wall,
        "decision_p50_us": sched.get("decision_p50_us", 0.0),
        "decision_p99_us": sched.get("decision_p99_us", 0.0),
        "decision_cpu_p99_us": sched.get("decision_cpu_p99_us", 0.0),
        "dispatch_p50_us": sched.get("dispatch_p50_us", 0.0),
        "dispatch_p99_us": sched.get("dispatch_p99_us", 0.0),
        "scheduler_cpu_utilisation": sched.get("cpu_utilisation", 0.0),
        "messages_per_s": (sched.get("messages_received", 0) + sched.get("messages_published", 0)) / wall,
        "engine_load_reports_per_s": sum(e.get("load_reports", 0) for e in report.get("engines", [])) / wall,
        "context_tokens_held_share": _held_share(report.get("turn_context_tokens") or {}),
        "bus_bytes_per_turn": (report.get("turn_bus_bytes") or {}).get("per_turn"),
    }


def _fault(watch: Watch, report: dict[str, Any]) -> dict[str, Any]:
    """What a scheduler killed mid-job cost: when the job was back in service, and what was lost."""
    return {
        "killed": watch.killed or None,
        "after_step": watch.kill_at_step if watch.killed_at is not None else None,
        "recovered_s": watch.recovered_s,
        "dispatching_s": watch.dispatching_s,
        "restarts": report.get("restarts", {}),
        "status": report.get("status"),
        "trajectories_lost": report.get("trajectories_lost"),
        "trajectories_trained_twice": report.get("trajectories_trained_twice"),
        "groups_replaced": report.get("groups_replaced"),
    }


def _held_share(context: dict[str, int]) -> float:
    """Of the context tokens its turns needed, the share their engines held already (context
    deltas: not sent again)."""
    held, sent = context.get("held_by_engines", 0), context.get("sent", 0)
    return held / (held + sent) if held + sent else 0.0


def _lending(lending: dict[str, Any] | None, scale: float) -> dict[str, Any] | None:
    """The job report's lending figures, seconds in emulated time as everything here."""
    if not lending:
        return None
    return {**lending, "seconds_lent": lending["seconds_lent"] / scale}


def _breakdown(watch: Watch, scale: float) -> dict[str, float]:
    """Mean emulated seconds per trajectory by where they went; `queue_s` and `generate_s` as the
    simulator counts them (waiting for a slot; in an engine's batch), the engine-side wait for a
    batch slot and the rest (bus, scheduler, retries) apart, as the simulator has neither."""
    n = len(watch.breakdowns) or 1

    def mean(xs: Any) -> float:
        return sum(xs) / n / scale

    out = {
        "queue_s": mean(b.scheduler_queue_s for b in watch.breakdowns),
        "engine_queue_s": mean(b.engine_queue_s for b in watch.breakdowns),
        "generate_s": mean(b.generate_s for b in watch.breakdowns),
        "tool_s": mean(b.tool_s for b in watch.breakdowns),
    }
    out["other_s"] = sum(watch.latencies) / n / scale - sum(out.values())
    return out


def predicted(cfg: RunConfig, workload: Workload, seeds: int) -> dict[str, Any]:
    """The simulator on the live job's configuration: with the live job's seed, so the same groups
    are drawn in the same admission order (common random numbers; the errors are against this
    run), and over `seeds` seeds from it (mean and 95% confidence interval: how much a different
    sample of the workload alone moves the figures)."""
    runs = [simulate(cfg, workload, seed) for seed in range(cfg.task.seed, cfg.task.seed + max(1, seeds))]

    def over_seeds(key: str) -> dict[str, Any]:
        m, ci = mean_ci([float(o[key]) for o in runs])
        return {"mean": m, "ci95": list(ci)}

    same = runs[0]
    return {
        "seed": cfg.task.seed,
        "trajectories_per_s": same["trajectories_per_s"],
        "latency_p50_s": same["rollout_latency_p50_s"],
        "latency_p99_s": same["rollout_latency_p99_s"],
        "migrations": same["bucket_migrations"],
        "lending": same["lending"],
        "latency_breakdown_mean_s": same["rollout_latency_breakdown_mean_s"],
        "train_step_s": same["train_step_s"],
        "push_s": same["push_s"],
        "over_seeds": {
            "seeds": len(runs),
            "trajectories_per_s": over_seeds("trajectories_per_s"),
            "latency_p50_s": over_seeds("rollout_latency_p50_s"),
            "latency_p99_s": over_seeds("rollout_latency_p99_s"),
        },
        "per_seed_trajectories_per_s": [o["trajectories_per_s"] for o in runs],
        "n_gpus": job_gpus(cfg),
    }


def _against_iterations(
    ns: argparse.Namespace,
    name: str,
    cfg: RunConfig,
    workload: Workload,
    directory: Path,
    span: tuple[float, float],
) -> dict[str, Any]:
    """The job's engine iterations against the profile's price of them (tools/engine_iterations.py),
    and the simulator's prediction again from the profile with the host sharing fitted to them."""
    from services.common.cost_model import load_profile
    from services.generation.iteration_log import read_engines
    from tools.engine_iterations import beside, compare, stale_profile, window, with_sharing

    engines = read_engines(directory) if directory.is_dir() else {}
    its = [it for xs in engines.values() for it in window(xs, *span)]
    if not its:
        return {"iterations": None, "predicted_live_fit": None}
    cm = load_profile(ns.profile)
    shared = beside(engines, cm, *span)
    out: dict[str, Any] = {"iterations": compare(its, cm) | {"host": shared}}
    if (warning := stale_profile(shared)) is not None:
        print(f"bench live: WARNING, {name}: {warning}", flush=True)
        out["profile_warning"] = warning
    sharing = shared["host_sharing_fitted"]
    if sharing is None:
        out["predicted_live_fit"] = None
        return out
    path = ns.out / f"profile-live-{name}.yaml"
    fitted = with_sharing(_profiled(ns), sharing, f"libra bench live: {ns.workload}, {name} ({ns.out})")
    path.write_text(yaml.safe_dump(fitted, sort_keys=False))
    data = cfg.model_dump(mode="json")
    data["rollout"]["emulated"]["profile"] = str(path.resolve())
    print(f"bench live: simulating {name} with the host sharing fitted live, {sharing:.2f} …", flush=True)
    pred = predicted(RunConfig.model_validate(data), workload, ns.sim_seeds)
    return out | {"predicted_live_fit": pred, "profile_live_fit": str(path)}


def gain_over_libra(results: dict[str, Any], name: str = "libra_lend", over: str = "libra") -> dict[str, Any]:
    """A policy's throughput over libra's (lending, a searched layout) or `over`'s, measured and
    predicted (the same seed; and the mean of the per-seed ratios with its 95 % CI), and how far
    apart the two gains are (points)."""
    lend, base = results[name], results[over]
    measured = lend["measured"]["trajectories_per_s"] / base["measured"]["trajectories_per_s"] - 1
    predicted = lend["predicted"]["trajectories_per_s"] / base["predicted"]["trajectories_per_s"] - 1
    ratios = [
        a / b - 1
        for a, b in zip(
            lend["predicted"]["per_seed_trajectories_per_s"],
            base["predicted"]["per_seed_trajectories_per_s"],
            strict=True,
        )
    ]
    m, ci = mean_ci(ratios)
    return {
        "measured": measured,
        "predicted": predicted,
        "predicted_over_seeds": {"mean": m, "ci95": list(ci), "per_seed": ratios},
        "error": abs(measured - predicted),
    }


def _seconds_line(m: dict[str, Any], pr: dict[str, Any]) -> str:
    """Training steps and pushes, measured against predicted (mean, min-max): where a miss that is
    not the engines' lies."""

    def spread(xs: list[float]) -> str:
        return f"{statistics.mean(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]" if xs else "-"

    return (
        f"steps {spread(m['train_step_s'])} measured, {spread(pr['train_step_s'])} predicted; "
        f"pushes {spread(m['push_s'])} measured, {spread(pr['push_s'])} predicted"
    )


def _note(ns: argparse.Namespace) -> str:
    """What in the run was real and what EMULATED (cost-model timings)."""
    engines = "EMULATED engines" if ns.backend == "emulated" else f"real {ns.backend} engines"
    training = "EMULATED training" if ns.trainer == "emulated" else "the real torch trainer"
    profile = f", predicted from the profile {ns.profile}" if ns.profile else ""
    return f"{engines} and {training}{profile}; the control plane is real"


def _fmt(breakdown: dict[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_s')} {v:.0f}" for k, v in breakdown.items())


def _error(m: float, p: float) -> float | None:
    return abs(m - p) / p if p > 0 else None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="libra bench live", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="r2e_gym", help="simulator workload (name or YAML path)")
    p.add_argument(
        "--backend",
        choices=("emulated", "vllm", "hf"),
        default="emulated",
        help="rollout engines: emulated (cost-model timings, default) or real ones (needs --profile)",
    )
    p.add_argument(
        "--trainer",
        choices=("emulated", "torch"),
        default="emulated",
        help="training: emulated (priced from the cost model, default) or the real torch trainer",
    )
    p.add_argument("--engines", type=int, help="rollout engines (default 16 emulated, 2 real)")
    p.add_argument(
        "--engines-per-host",
        type=int,
        default=1,
        help="emulated engines served by one process (default 1; hundreds of engines fit this machine "
        "only as hosts of many)",
    )
    p.add_argument("--out", required=True, type=Path, help="directory for live.json, configs and logs")
    p.add_argument(
        "--time-scale", type=float, help="wall seconds per emulated second (default 0.12; real engines: 1)"
    )
    p.add_argument("--steps", type=int, default=6, help="train steps (throughput: steps 2 to N-1)")
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument(
        "--long-tp", type=int, help="TP of the long bucket (the short one is TP1; default 2, real engines 1)"
    )
    p.add_argument("--short-bucket-tokens", type=int, help="C-MLFQ threshold (default: median output)")
    p.add_argument("--train-gpus", type=int, default=8)
    p.add_argument("--train-tp", type=int, default=2)
    p.add_argument("--lend-tp", type=int, default=4, help="TP of the engines libra_lend lends (default 4)")
    p.add_argument("--gpu", default="H100")
    p.add_argument("--model", default="qwen3-14b")
    p.add_argument(
        "--profile",
        type=Path,
        help="a `libra calibrate` profile: engines, training and the simulator's prediction all price "
        "what it measured instead of --gpu and --model",
    )
    p.add_argument(
        "--max-engines", type=int, default=24, help=f"most engine processes {PLANNED}'s layout may need"
    )
    p.add_argument(
        "--replan-interval-s",
        type=float,
        default=20.0,
        help="wall seconds between the re-plans of libra_refit and libra_relayout (default 20)",
    )
    p.add_argument(
        "--standby-schedulers",
        type=int,
        default=0,
        help="schedulers standing by to take the job over (default 0)",
    )
    p.add_argument(
        "--kill-scheduler-at-step",
        type=int,
        default=0,
        help="a fault: kill -9 the scheduler once this step is committed; live.json's `fault` says "
        "when the job was back in service and what was lost (default 0: none)",
    )
    p.add_argument(
        "--lease-ttl-s",
        type=float,
        help="job.lease_ttl_s of the jobs (default: the run config's, 10 s); hundreds of engines on "
        "a few cores renew late, and a lease that lapses costs a re-plan sent to every engine",
    )
    p.add_argument("--sim-seeds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policies", default="libra,least_loaded", help=f"comma-separated, of: {', '.join(POLICIES)}"
    )
    return p


def _stalls(spread: dict[str, Any] | None) -> str:
    """The beside iterations' spread in a few words: a shift of the median, or a tail of stalls."""
    if not spread:
        return ""
    return (
        f" (median {spread['median']}x, mean {spread['mean']}x; {spread['stalled']:.0%} of them stalled "
        f"past {STALL:g}x the median, {spread['stalled_time']:.0%} of their time)"
    )


def main(argv: list[str] | None = None) -> int:
    p = parser()
    ns = p.parse_args(argv)
    policies = [x.strip() for x in ns.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in POLICIES]
    if unknown:
        p.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    try:
        settle(ns)
        workload = Workload.load(ns.workload)
    except (ValueError, OSError, yaml.YAMLError) as err:
        p.error(str(err))
    out: Path = ns.out
    out.mkdir(parents=True, exist_ok=True)
    configs = {}
    layouts: dict[str, dict[str, Any]] = {}
    searched: dict[str, RunConfig] = {}
    for name in policies:
        try:
            data = live_config(
                ns, workload, POLICIES[name], lend=LENDING.get(name), relayout=REPLANNED.get(name)
            )
        except ValueError as err:
            p.error(str(err))
        path = out / f"config-{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        configs[name] = (path, RunConfig.model_validate(data))
        if name == PLANNED:  # the job searches its layout as it starts: the same search, here first
            data["name"] = "bench-live-planned"
            data["planner"]["layout"] = {"search": True, "max_engines": ns.max_engines}
            searched[name] = RunConfig.model_validate(data)
            path.write_text(yaml.safe_dump(data, sort_keys=False))
            cfg, layouts[name] = choose_layout(searched[name], workload)
            print(summary(layouts[name]), flush=True)
            configs[name] = (path, cfg)  # the layout the job will run: the stack's size, the prediction

    env = {"LIBRA_SCHEDULER_STATS_INTERVAL_S": "2", "LIBRA_ROLLOUT_ENGINE_MAX_NEW_TOKENS_CAP": "32768"}
    iteration_dir = out / "iterations"
    if ns.backend == "vllm":  # every iteration the engines run, to set against the cost model
        env["LIBRA_ROLLOUT_ENGINE_ITERATION_LOG"] = str(iteration_dir.resolve())
    stack = Stack(
        f"bench-live-{int(time.time())}", out / "logs", extra_env=env, engines_per_host=ns.engines_per_host
    )
    windows: dict[str, tuple[float, float]] = {}
    results: dict[str, Any] = {}
    stack.start_infra(
        max(cfg.engines_needed for _, cfg in configs.values()), standby_schedulers=ns.standby_schedulers
    )
    try:
        stack.start_services()
        for name in policies:
            path, cfg = configs[name]
            run_id = f"live-{name}-{int(time.time())}"
            watch = Watch(kill_at_step=ns.kill_scheduler_at_step)
            watcher = _watch(stack, run_id, watch)
            print(
                f"bench live: {name} ({cfg.rollout.policy}) on {cfg.engines_needed} {ns.backend} engines, "
                f"{ns.trainer} training …",
                flush=True,
            )
            started = time.time()
            with host_cpu.Meter() as cpu:
                report = run_job(
                    path,
                    searched.get(name, cfg),
                    run_id=run_id,
                    runs_dir=out / "runs",
                    progress=True,
                    stack=stack,
                )
            windows[name] = (started, time.time())
            if name in layouts and report.get("layout", {}).get("chosen") != layouts[name]["chosen"]:
                raise RuntimeError(f"{name}: the job chose another layout than the search before it")
            watch.stop.set()
            watcher.join(10)
            results[name] = {
                "measured": measured(watch, report, cfg),
                "report": report.get("report_path"),
                "host_cpu": {"cores": os.cpu_count(), "by_role": cpu.usage},
            }
            if watch.kill_at_step:
                results[name]["fault"] = _fault(watch, report)
    finally:
        stack.stop()

    for name in policies:
        _, cfg = configs[name]
        print(f"bench live: simulating {name} ({ns.sim_seeds} seeds) …", flush=True)
        pred = predicted(cfg, workload, ns.sim_seeds)
        m = results[name]["measured"]
        results[name]["predicted"] = pred
        results[name]["throughput_error"] = _error(m["trajectories_per_s"], pred["trajectories_per_s"])
        results[name]["p50_error"] = _error(m["latency_p50_s"], pred["latency_p50_s"])
        results[name]["p99_error"] = _error(m["latency_p99_s"], pred["latency_p99_s"])
        results[name]["migrations"] = m["migrations"]
        if name in layouts:
            results[name]["layout"] = layouts[name]
        if ns.backend == "vllm":
            results[name].update(_against_iterations(ns, name, cfg, workload, iteration_dir, windows[name]))
            fitted = results[name]["predicted_live_fit"]
            if fitted is not None:
                fitted["throughput_error"] = _error(m["trajectories_per_s"], fitted["trajectories_per_s"])
                fitted["p99_error"] = _error(m["latency_p99_s"], fitted["latency_p99_s"])
    first = results[policies[0]]["measured"]
    gains = {n: gain_over_libra(results, n) for n in LENDING if {"libra", n} <= set(policies)}
    gain = gains.get("libra_lend")
    doc = {
        "workload": ns.workload,
        "engines": ns.engines,
        "backend": ns.backend,
        "trainer": ns.trainer,
        "emulated": ns.backend == "emulated" or ns.trainer == "emulated",
        "note": _note(ns),
        "time_scale": ns.time_scale,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(ns).items() if k != "out"}
        | {"out": str(out)},
        "targets": TARGETS,
        "policies": results,
        "lending_gain": gain,
        "lending_gain_always": gains.get("libra_lend_always"),
        "layout_gain": gain_over_libra(results, PLANNED) if {"libra", PLANNED} <= set(policies) else None,
        "relayout_gain": (
            gain_over_libra(results, "libra_relayout", "libra_refit")
            if set(REPLANNED) <= set(policies)
            else None
        ),
        "scheduler": {
            "policy": policies[0],
            "decisions_per_s": first["decisions_per_s"],
            "decision_p50_us": first["decision_p50_us"],
            "decision_p99_us": first["decision_p99_us"],
            "decision_cpu_p99_us": first["decision_cpu_p99_us"],
            "dispatch_p50_us": first["dispatch_p50_us"],
            "dispatch_p99_us": first["dispatch_p99_us"],
            "cpu_utilisation": first["scheduler_cpu_utilisation"],
            "messages_per_s": first["messages_per_s"],
            "engine_load_reports_per_s": first["engine_load_reports_per_s"],
            "bus_bytes_per_turn": first["bus_bytes_per_turn"],
        },
    }
    (out / "live.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    for name in policies:
        r = results[name]
        m, pr = r["measured"], r["predicted"]
        print(
            f"{name:>12}: measured {m['trajectories_per_s']:.4f} traj/s, p99 {m['latency_p99_s']:.0f} s | "
            f"predicted {pr['trajectories_per_s']:.4f} traj/s, p99 {pr['latency_p99_s']:.0f} s | "
            f"errors: throughput {r['throughput_error']}, p99 {r['p99_error']}; migrations {r['migrations']}"
        )
        print(f"{'':>12}  mean s per trajectory, measured {_fmt(m['latency_breakdown_mean_s'])}")
        print(f"{'':>12}  mean s per trajectory, predicted {_fmt(pr['latency_breakdown_mean_s'])}")
        print(f"{'':>12}  training, s: {_seconds_line(m, pr)}")
        print(f"{'':>12}  host CPU over the job, cores: {host_cpu.line(r['host_cpu']['by_role'])}")
        print(
            f"{'':>12}  scheduler: {m['decisions_per_s']:.1f} decisions/s, decision p99 "
            f"{m['decision_p99_us']:.0f} us ({m['decision_cpu_p99_us']:.0f} us of CPU), dispatch p99 "
            f"{m['dispatch_p99_us'] / 1000:.1f} ms, {m['scheduler_cpu_utilisation']:.2f} core, "
            f"{m['messages_per_s']:.0f} messages/s; engine load reports {m['engine_load_reports_per_s']:.1f}/s; "
            f"bus bytes per turn {m['bus_bytes_per_turn']}"
        )
        if (f := r.get("fault")) is not None:
            back = f"{f['recovered_s']:.1f} s" if f["recovered_s"] is not None else "never"
            sent = f"{f['dispatching_s']:.1f} s" if f.get("dispatching_s") is not None else "never"
            print(
                f"{'':>12}  scheduler killed after step {f['after_step']}: turns sent again after {sent}, "
                f"back in service after {back}; "
                f"lost {f['trajectories_lost']}, trained twice {f['trajectories_trained_twice']}, "
                f"restarts {f['restarts']}"
            )
        if r.get("iterations"):
            a, fitted = r["iterations"]["all"], r.get("predicted_live_fit")
            print(
                f"{'':>12}  engine iterations: {a['iterations']}, live {a['live_over_priced']}x the profile's "
                f"price (forward alone {a['forward_over_priced']}x), mean decode batch "
                f"{r['iterations']['decode_batch_mean']}; alone "
                f"{r['iterations']['host']['alone']['live_over_priced']}x, beside another engine "
                f"{r['iterations']['host']['beside_another']['live_over_priced']}x"
                + _stalls(r["iterations"]["host"]["beside_another"].get("spread"))
                + (
                    f"; predicted with the host sharing fitted live "
                    f"({r['iterations']['host']['host_sharing_fitted']:.2f}) "
                    f"{fitted['trajectories_per_s']:.4f} traj/s, "
                    f"p99 {fitted['latency_p99_s']:.0f} s (errors {fitted['throughput_error']}, "
                    f"{fitted['p99_error']})"
                    if fitted
                    else ""
                )
            )
        if r.get("profile_warning"):
            print(f"{'':>12}  WARNING: {r['profile_warning']}")
    if doc["layout_gain"] is not None:
        gains[PLANNED] = doc["layout_gain"]
    if doc["relayout_gain"] is not None:
        gains["libra_relayout over libra_refit"] = doc["relayout_gain"]
    for name, gain in gains.items():
        print(
            f"{name}: measured gain {gain['measured']:+.1%}, predicted {gain['predicted']:+.1%} "
            f"(over seeds {gain['predicted_over_seeds']['mean']:+.1%}, 95 % CI "
            f"[{gain['predicted_over_seeds']['ci95'][0]:+.1%}, {gain['predicted_over_seeds']['ci95'][1]:+.1%}]); "
            f"error {gain['error']:.1%}"
        )
    print(f"wrote {out / 'live.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
