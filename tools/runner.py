"""`libra run`: one job on a local stack, watched over the bus, summarised in runs/<run-id>/report.json."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import ev, ws, ws_grpc
from services.common.runconfig import RunConfig
from tools.stack import ROOT, Stack, read_stack_file


class JobFailed(RuntimeError):
    pass


async def engine_versions(plan: ev.Plan | None) -> list[dict[str, Any]]:
    """Asks every rollout engine in the plan, over gRPC, which weight version it serves."""
    import grpc

    out = []
    for a in plan.assignments if plan else []:
        if a.role not in ("rollout", "hybrid"):
            continue
        entry: dict[str, Any] = {
            "id": a.worker_id,
            "bucket": a.bucket,
            "weight_sync_addr": a.weight_sync_addr,
        }
        try:
            async with grpc.aio.insecure_channel(a.weight_sync_addr) as ch:
                info = await ws_grpc.WeightSyncStub(ch).GetVersion(ws.VersionRequest(), timeout=10)
            entry.update(weight_version=info.version, checksum=info.checksum)
        except grpc.RpcError as err:
            entry.update(weight_version=None, error=str(err.code()))
        out.append(entry)
    return out


async def watch_job(stack: Stack, cfg: RunConfig, timeout_s: float, progress: bool = True) -> dict[str, Any]:
    """Follows train metrics until the trainer reports its last step; fails fast if a service dies."""
    from tqdm import tqdm

    bus = await Bus.connect(stack.nats_url, stack.run_id, "cli", f"cli-{os.getpid()}")
    metrics: list[ev.TrainMetrics] = []
    pushes: list[ev.WeightsUpdated] = []
    done = asyncio.Event()

    async def on_metrics(m: ev.TrainMetrics, _: Envelope) -> None:
        metrics.append(m)
        if m.done:
            done.set()

    async def on_weights(w: ev.WeightsUpdated, _: Envelope) -> None:
        pushes.append(w)

    await bus.subscribe(subjects.TRAIN_METRICS, ev.TrainMetrics, on_metrics)
    await bus.subscribe(subjects.WEIGHTS_UPDATED, ev.WeightsUpdated, on_weights)
    bar = tqdm(
        total=cfg.training.steps,
        desc="train steps",
        unit="step",
        disable=not progress,
        file=sys.stderr,
        mininterval=1.0 if sys.stderr.isatty() else 30.0,  # a log file gets a line every 30 s
        bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}] {postfix}",
    )
    start = time.monotonic()
    stats = ev.SchedulerStats()
    try:
        while not done.is_set():
            await asyncio.sleep(1.0)
            dead = stack.dead()
            if dead:
                name, code = next(iter(dead.items()))
                raise JobFailed(
                    f"service {name} exited with code {code}; last log lines:\n{stack.log_tail(name)}"
                )
            if time.monotonic() - start > timeout_s:
                raise JobFailed(f"job did not finish within {timeout_s:.0f}s (see logs in {stack.log_dir})")
            with contextlib.suppress(Exception):
                stats = await bus.request(
                    subjects.SCHEDULER_STATS, ev.StatsRequest(), ev.SchedulerStats, timeout=2
                )
            steps = max((m.step for m in metrics), default=0)
            bar.n = steps
            reward = f"{metrics[-1].reward_mean:.3f}" if metrics else "-"
            bar.set_postfix_str(
                f"trajectories={stats.trajectories_completed} in_flight={stats.trajectories_in_flight} reward={reward}",
                refresh=False,
            )
            bar.update(0)
        wall = time.monotonic() - start
        stats = await bus.request(subjects.SCHEDULER_STATS, ev.StatsRequest(), ev.SchedulerStats, timeout=5)
        plan_stream = await bus.ensure_stream("PLAN", [subjects.PLAN], max_msgs_per_subject=1)
        plan = await bus.last_message(subjects.PLAN, plan_stream, ev.Plan)
        engines = await engine_versions(plan)
    finally:
        bar.close()
        await bus.close()
    trained = per_step(metrics)
    final = max((m.weight_version for m in metrics), default=0)
    return {
        "run_id": stack.run_id,
        "config": str(stack.config),
        "model": cfg.model.source,
        "rollout_backend": cfg.rollout.backend
        + (
            " (emulated: timings from the cost model, no real generation)"
            if cfg.rollout.backend == "emulated"
            else ""
        ),
        "wall_s": round(wall, 2),
        "trajectories_completed": stats.trajectories_completed,
        "trajectories_per_s": round(stats.trajectories_completed / wall, 4) if wall > 0 else 0.0,
        "turns": stats.turns,
        "train_steps": len(trained),
        "final_weight_version": final,
        "engines": engines,
        "all_engines_on_final_version": bool(engines)
        and all(e.get("weight_version") == final for e in engines),
        "reward_mean_per_step": [round(m.reward_mean, 4) for m in trained],
        "loss_per_step": [round(m.loss, 5) for m in trained],
        "step_s": [round(m.step_s, 2) for m in trained],
        "weight_push": [
            {
                "version": w.version,
                "seconds": round(w.push_s, 3),
                "bytes": w.size_bytes,
                "engines": list(w.engines),
            }
            for w in pushes
        ],
        "tool_calls": dict(stats.tool_calls_by_status),
        "services": {name: p.pid for name, p in stack.procs.items()},
        "nats_url": stack.nats_url,
        "redis_url": stack.redis_url,
    }


def per_step(metrics: list[ev.TrainMetrics]) -> list[ev.TrainMetrics]:
    """One metrics message per train step, in step order.

    The last step's metrics may carry ``done`` themselves or be repeated in a separate ``done`` message
    once every engine has the final weights; both count as that one step.
    """
    first: dict[int, ev.TrainMetrics] = {}
    for m in metrics:
        if m.step > 0:
            first.setdefault(m.step, m)
    return [first[s] for s in sorted(first)]


def write_report(report: dict[str, Any], runs_dir: Path) -> Path:
    out = runs_dir / report["run_id"]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    latest = runs_dir / "latest"
    if latest.is_symlink() or latest.exists():
        latest.unlink()
    latest.symlink_to(out.name)
    return path


def run_job(
    config_path: Path,
    cfg: RunConfig,
    *,
    run_id: str | None = None,
    runs_dir: Path = ROOT / "runs",
    timeout_s: float = 1800.0,
    otlp_endpoint: str | None = None,
    progress: bool = True,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    from services.common.models import resolve_model_dir

    run_id = run_id or f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"preparing model '{cfg.model.source}' (converted once, then cached)…", file=sys.stderr)
    resolve_model_dir(cfg.model)
    stack = Stack(run_id, config_path, runs_dir / run_id / "logs", otlp_endpoint, dict(extra_env or {}))
    live = read_stack_file()
    stack.start_infra(
        reuse={"nats_url": str(live["nats_url"]), "redis_url": str(live["redis_url"])} if live else None
    )
    print(
        f"run {run_id}: nats {stack.nats_url}  redis {stack.redis_url}  logs {stack.log_dir}", file=sys.stderr
    )
    try:
        stack.start_services(cfg.rollout.engines)
        report = asyncio.run(watch_job(stack, cfg, timeout_s, progress))
    finally:
        stack.stop()
    report["report_path"] = str(write_report(report, runs_dir))
    return report
