"""Run one system on one workload and summarise what a user compares: throughput and where GPU time went."""

from __future__ import annotations

import time
from typing import Any

from services.common.cost_model import CostModel
from services.common.synthetic import TrajectorySource
from services.simulation.ledger import CATEGORIES
from services.simulation.simulator import Simulator
from services.simulation.state import SystemConfig


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile as the simulator reports it (nearest rank, no interpolation)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def steady_rate(step_ends: list[float], per_step: float, drained: bool = False) -> float:
    """Trajectories trained per second between the first and the last step's end (the first step
    is warm-up). With `drained`, the last step is left out too: a job with a finite feed ends by
    waiting for the groups already out (`SystemConfig.job_groups`), which is the job's end, not its
    steady state."""
    ends = step_ends[:-1] if drained else step_ends
    if len(ends) < 2 or ends[-1] <= ends[0]:
        return 0.0
    return per_step * (len(ends) - 1) / (ends[-1] - ends[0])


def run_system(
    system: SystemConfig,
    workload: TrajectorySource,
    cm: CostModel,
    n_gpus: int,
    steps: int,
    seed: int,
    tick_s: float = 2.0,
    progress: Any = None,
) -> tuple[dict[str, Any], Simulator]:
    sim = Simulator(system, workload, cm, n_gpus, steps, seed, tick_s, progress)
    t0 = time.perf_counter()
    sim.run()
    wall = time.perf_counter() - t0
    return summarize(sim, wall), sim


def summarize(sim: Simulator, wall_s: float) -> dict[str, Any]:
    end = sim.now
    ends = sim.step_ends
    trained = sum(sim.step_trajs)
    tokens = sum(sim.step_tokens)
    if len(ends) > 1:
        span = ends[-1] - ends[0]
        steady_traj = sum(sim.step_trajs[1:]) / span
        steady_tok = sum(sim.step_tokens[1:]) / span
    else:
        steady_traj, steady_tok = trained / end, tokens / end
    gpu_s = sim.n_gpus * end
    busy = {c: sim.ledger.totals.get(c, 0.0) / gpu_s for c in CATEGORIES}
    s = sim.sys
    return {
        "system": s.name,
        "trajectories_per_s": steady_traj,
        "trained_tokens_per_s": steady_tok,
        "trajectories_per_s_incl_warmup": trained / end,
        "trained_tokens_per_s_incl_warmup": tokens / end,
        "step_times_s": [b - a for a, b in zip([0.0, *ends[:-1]], ends, strict=True)],
        "step_end_s": ends,
        "gpu_fraction": busy,
        "gpu_seconds_accounted": sim.ledger.total(),
        "gpu_seconds_total": gpu_s,
        "rollout_latency_p50_s": percentile(sim.latencies, 0.5),
        "rollout_latency_p99_s": percentile(sim.latencies, 0.99),
        "rollout_latency_breakdown_mean_s": latency_breakdown(sim.latencies, sim.waits),
        "trajectories_finished": sim.finished,
        "trajectories_trained": trained,
        "dropped_stale_groups": sim.dropped_groups,
        "trained_staleness_mean": _mean(sim.trained_staleness),
        "trained_token_staleness_mean": _mean(sim.trained_token_staleness),
        "speculation": speculation_stats(sim),
        "kv_migration": {
            "moves": sim.kvm.moves,
            "sent_tokens": sim.kvm.sent_tokens,
            "received_tokens": sim.kvm.received_tokens,
            "fallbacks": sim.kvm.fallbacks,
        },
        "bucket_migrations": sim.migrations,
        "lending": {
            "policy": s.lend_policy,
            "lends": sim.training.lends,
            "reclaims": sim.training.reclaims,
            "early_reclaims": sim.training.early_reclaims,
        }
        if s.lend_tp
        else None,
        "reprefill_tokens": sim.reprefill_tokens,
        "replans": sim.replanner.replans if sim.replanner is not None else [],
        "allocation": {
            "mode": s.mode,
            "train_gpus": s.train_gpus if s.mode == "async" else sim.n_gpus,
            "train_tp": s.train_tp,
            "buckets": [
                {"name": b.name, "tp": b.tp, "replicas": b.replicas, "max_tokens": b.max_tokens}
                for b in s.buckets
            ],
            "hybrid_gpus": s.hybrid_gpus,
            "staleness": s.staleness if s.mode == "async" else 0,
            **{k: v for k, v in s.notes.items() if k != "profile"},
        },
        "sim_time_s": end,
        "wall_s": wall_s,
        "events": sim.n_events,
        "events_per_s": sim.n_events / wall_s if wall_s > 0 else 0.0,
    }


def latency_breakdown(latencies: list[float], waits: list[tuple[float, float]]) -> dict[str, float]:
    """Mean seconds per trajectory queued for an engine slot, in tools, and the rest (generation:
    prefill, decode, stalls for weight loads)."""
    n = len(latencies) or 1
    queue = sum(w[0] for w in waits) / n
    tool = sum(w[1] for w in waits) / n
    return {"queue_s": queue, "tool_s": tool, "generate_s": sum(latencies) / n - queue - tool}


def speculation_stats(sim: Simulator) -> dict[str, Any]:
    """Drafted and accepted tokens over every engine, and the mean tokens a verify step emitted."""
    drafted = sum(e.drafted for e in sim.engines.values())
    accepted = sum(e.accepted for e in sim.engines.values())
    steps = sum(e.seq_iters for e in sim.engines.values())
    return {
        "drafter": sim.sys.drafter if sim.spec is not None else "none",
        "policy": f"{sim.sys.speculation.mode}/k{sim.sys.speculation.draft_tokens}" if sim.spec else "off",
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_verify_step": (steps + accepted) / steps if steps else 1.0,
    }


def _mean(xs: list[float] | list[int]) -> float:
    return sum(xs) / len(xs) if xs else 0.0
