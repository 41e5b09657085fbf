"""Allocation search: training GPUs and parallelism, rollout buckets and the hybrid pool.

The objective is the steady-state step time max(T_train, T_rollout): in an asynchronous pipeline
the slower stage sets the pace. Rollout time per bucket is the larger of a throughput bound (its
share of tokens over its replicas at the batch it can hold) and a tail bound (its longest
trajectory decoded at a small batch, plus that trajectory's tool time).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from services.common.cost_model import CostModel, GPUSpec, ModelSpec


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    n_gpus: int
    gpu: GPUSpec


@dataclass
class WorkloadStats:
    """What the planner needs to know about one RL step's rollouts, measured or sampled."""

    trajectories_per_step: int
    output_tokens: Sequence[float]
    """A sample of trajectories' total output tokens; sorted on construction."""
    mean_turns: float
    mean_tool_s: float
    """Tool time per turn, seconds."""
    prompt_tokens: float
    context_per_output: float = 1.5
    """Final context tokens per output token (tool outputs also land in the context)."""

    def __post_init__(self) -> None:
        self.output_tokens = sorted(float(x) for x in self.output_tokens)
        self._prefix = [0.0, *itertools.accumulate(self.output_tokens)]

    @property
    def mean_output(self) -> float:
        return self._prefix[-1] / max(1, len(self.output_tokens))

    @property
    def mean_context(self) -> float:
        mean_out = self._prefix[-1] / max(1, len(self.output_tokens))
        return self.prompt_tokens + self.context_per_output * mean_out

    def slice(self, lo: float, hi: float) -> tuple[float, float, float]:
        """(fraction of trajectories, mean output, tail output) with output in (lo, hi]."""
        xs = self.output_tokens
        i, j = bisect.bisect_right(xs, lo), bisect.bisect_right(xs, hi)
        if j <= i:
            return 0.0, 0.0, 0.0
        n = j - i
        frac = n / len(xs)
        tail_idx = i + min(
            n - 1, max(0, math.ceil(n * (1 - 1 / max(1.0, frac * self.trajectories_per_step))) - 1)
        )
        return frac, (self._prefix[j] - self._prefix[i]) / n, xs[tail_idx]

    def quantile(self, q: float) -> float:
        xs = self.output_tokens
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


@dataclass(slots=True)
class BucketPlan:
    name: str
    tp: int
    replicas: int
    max_tokens: float

    @property
    def gpus(self) -> int:
        return self.tp * self.replicas


@dataclass(slots=True)
class Plan:
    train_gpus: int
    train_tp: int
    buckets: list[BucketPlan]
    hybrid_gpus: int = 0
    """TP1 rollout engines in the first bucket that may join training as extra DP replicas."""
    t_train: float = 0.0
    t_rollout: float = 0.0

    @property
    def train_dp(self) -> int:
        return self.train_gpus // self.train_tp

    @property
    def rollout_gpus(self) -> int:
        return sum(b.gpus for b in self.buckets)

    @property
    def total_gpus(self) -> int:
        return self.train_gpus + self.rollout_gpus + self.hybrid_gpus

    @property
    def step_time(self) -> float:
        return max(self.t_train, self.t_rollout)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["train_dp"] = self.train_dp
        d["step_time"] = self.step_time
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(
            train_gpus=int(data["train_gpus"]),
            train_tp=int(data["train_tp"]),
            buckets=[BucketPlan(**b) for b in data["buckets"]],
            hybrid_gpus=int(data.get("hybrid_gpus", 0)),
            t_train=float(data.get("t_train", 0.0)),
            t_rollout=float(data.get("t_rollout", 0.0)),
        )


@dataclass(slots=True)
class SearchOptions:
    bucket_tps: tuple[int, ...] = (1, 2, 4)
    bucket_names: tuple[str, ...] = ("short", "medium", "long")
    threshold_quantiles: tuple[float, ...] = (0.5, 0.7, 0.85, 0.95)
    max_seqs: int = 128
    hybrid: bool = True
    max_hybrid_fraction: float = 0.25
    fixed_train_gpus: int | None = None
    train_tps: tuple[int, ...] = (1, 2, 4, 8)
    grid: int = 24
    """Rollout GPUs are split between buckets in steps of about 1/grid."""
    sync_s: float = 0.0
    """Per-step weight sync added to training time."""
    rollout_scale: float = 1.0
    """Measured / predicted rollout time of recent steps (calibration of the analytical model)."""
    train_scale: float = 1.0
    """Measured / predicted training time of recent steps."""
    staleness: int = 0
    """Steps of rollout that overlap (bounded staleness); tails are spread over 1 + staleness steps."""


def bucket_time(cm: CostModel, stats: WorkloadStats, b: BucketPlan, lo: float, opts: SearchOptions) -> float:
    """Seconds for bucket `b` to finish the trajectories whose output falls in (lo, b.max_tokens]."""
    frac, mean_out, tail = stats.slice(lo, b.max_tokens)
    n = frac * stats.trajectories_per_step
    work = n * mean_out
    if lo == -math.inf:
        # Every trajectory starts in the first bucket and leaves it after its first tool return.
        others = (1 - frac) * stats.trajectories_per_step
        first_turn = stats.mean_output / max(1.0, stats.mean_turns)
        work += others * first_turn
        n += others * 0.5
    if n <= 0:
        return 0.0
    if b.replicas <= 0:
        return math.inf
    ctx_final = stats.prompt_tokens + stats.context_per_output * mean_out
    ctx_avg = (stats.prompt_tokens + ctx_final) / 2
    cap = max(1, min(opts.max_seqs, int(cm.kv_capacity_tokens(b.tp) / max(1.0, ctx_final))))
    batch = max(1.0, min(cap, n * (1 + opts.staleness) / b.replicas))
    thr = work / (b.replicas * batch) * cm.decode_step_s(int(batch), ctx_avg, b.tp)
    tail_ctx = stats.prompt_tokens + stats.context_per_output * tail / 2
    tail_t = tail * cm.decode_step_s(int(min(batch, 8)), tail_ctx, b.tp)
    tail_t += stats.mean_turns * (tail / max(1.0, mean_out)) ** 0.5 * stats.mean_tool_s
    tail_t /= 1 + opts.staleness
    # Each replica prefills every context it serves once (the prompt and the tool returns; about
    # half the final context), one sequence after another: prefill does not shrink with batch.
    prefill = n / b.replicas * cm.prefill_s(int(ctx_final), 0, b.tp) * 0.5
    return max(thr + prefill, tail_t)


def rollout_time(
    cm: CostModel, stats: WorkloadStats, buckets: Sequence[BucketPlan], opts: SearchOptions
) -> float:
    t, lo = 0.0, -math.inf
    for b in buckets:
        t = max(t, bucket_time(cm, stats, b, lo, opts))
        lo = b.max_tokens
    return t * opts.rollout_scale


def train_time(cm: CostModel, stats: WorkloadStats, gpus: float, tp: int, opts: SearchOptions) -> float:
    tokens = stats.trajectories_per_step * stats.mean_context
    t = cm.train_step_s(tokens, stats.mean_context, int(gpus) if gpus >= 1 else 0, tp)
    return t * opts.train_scale + opts.sync_s


def _splits(total_units: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(total_units,)]
    return [(i, *rest) for i in range(total_units + 1) for rest in _splits(total_units - i, parts - 1)]


def _thresholds(stats: WorkloadStats, parts: int, opts: SearchOptions) -> list[tuple[float, ...]]:
    qs = sorted({stats.quantile(q) for q in opts.threshold_quantiles})
    return [(*c, math.inf) for c in itertools.combinations(qs, parts - 1)] or [(math.inf,) * parts]


def best_layout(
    cm: CostModel, stats: WorkloadStats, gpus: int, opts: SearchOptions, hybrid: int = 0
) -> tuple[list[BucketPlan], float]:
    """The bucket layout (thresholds and replicas per TP degree) with the lowest rollout time.

    Every bucket keeps at least one replica of its own: C-MLFQ may route any trajectory anywhere.
    """
    tps = opts.bucket_tps
    unit = max(1, math.ceil(gpus / opts.grid))
    units = gpus // unit
    best: tuple[list[BucketPlan], float] = ([], math.inf)
    for thresholds in _thresholds(stats, len(tps), opts):
        for split in _splits(units, len(tps)):
            share = [s * unit for s in split]
            share[0] += gpus - units * unit
            for i in range(1, len(share)):
                share[0] += share[i] % tps[i]
            buckets = [
                BucketPlan(
                    opts.bucket_names[i] if i < len(opts.bucket_names) else f"b{i}", tp, share[i] // tp, thr
                )
                for i, (tp, thr) in enumerate(zip(tps, thresholds, strict=True))
            ]
            if any(b.replicas == 0 for b in buckets):
                continue
            buckets[0].replicas += hybrid
            t = rollout_time(cm, stats, buckets, opts)
            buckets[0].replicas -= hybrid
            if t < best[1]:
                best = (buckets, t)
    return best


def search(
    cluster: ClusterSpec,
    model: ModelSpec,
    stats: WorkloadStats,
    cost_model: CostModel,
    options: SearchOptions | None = None,
) -> Plan:
    """Minimise max(T_train, T_rollout) over training size/TP, bucket layout and hybrid pool size.

    Two passes keep it cheap at 1,024 GPUs: training sizes with no hybrid pool first, then
    hybrid pool sizes around the best few training sizes.
    """
    opts = options or SearchOptions()
    cm = cost_model
    if cm.model.name != model.name:
        raise ValueError("cost model was built for another model")
    n = cluster.n_gpus
    step = max(1, min(cluster.gpu.gpus_per_node, max(opts.bucket_tps)), n // 32)
    lo = max(cm.min_train_gpus(), 1)
    if opts.fixed_train_gpus:
        candidates = [opts.fixed_train_gpus]
    else:
        candidates = list(range(math.ceil(lo / step) * step, n, step))
    plans: list[Plan] = []
    for tg in candidates:
        plan = _plan_at(cm, stats, cluster, tg, 0, opts)
        if plan is not None:
            plans.append(plan)
    if not plans:
        raise ValueError(f"no feasible plan for {n} GPUs (training needs {lo})")
    plans.sort(key=lambda p: p.step_time)
    best = plans[0]
    if opts.hybrid and opts.bucket_tps[0] == 1:
        for base in plans[:3]:
            rest = n - base.train_gpus
            h_max = int(rest * opts.max_hybrid_fraction)
            for h in sorted({round(h_max * i / 4) for i in range(1, 5)} - {0}):
                plan = _plan_at(cm, stats, cluster, base.train_gpus, h, opts)
                if plan is not None and plan.step_time < best.step_time - 1e-9:
                    best = plan
    return best


def _plan_at(
    cm: CostModel, stats: WorkloadStats, cluster: ClusterSpec, tg: int, h: int, opts: SearchOptions
) -> Plan | None:
    tps = [tp for tp in opts.train_tps if tg % tp == 0 and tp <= cluster.gpu.gpus_per_node] or [1]
    tp = min(tps, key=lambda t: train_time(cm, stats, tg, t, opts))
    buckets, t_roll = best_layout(cm, stats, cluster.n_gpus - tg - h, opts, hybrid=h)
    if not buckets:
        return None
    t_train = _train_with_hybrid(cm, stats, tg, tp, h, buckets, t_roll, opts)
    return Plan(tg, tp, buckets, h, t_train, t_roll)


def _train_with_hybrid(
    cm: CostModel,
    stats: WorkloadStats,
    tg: int,
    tp: int,
    h: int,
    buckets: list[BucketPlan],
    t_roll: float,
    opts: SearchOptions,
) -> float:
    """Training time when `h` hybrid GPUs lend the part of the step their bucket leaves idle."""
    t = train_time(cm, stats, tg, tp, opts)
    if h == 0:
        return t
    b0 = BucketPlan(buckets[0].name, buckets[0].tp, buckets[0].replicas + h, buckets[0].max_tokens)
    busy = bucket_time(cm, stats, b0, -math.inf, opts) * opts.rollout_scale
    free = max(0.0, 1 - busy / max(t_roll, t, 1e-9)) * h
    return train_time(cm, stats, tg + free, tp, opts) + cm.state_fetch_s(tg) * (free > 0)


def evaluate(cm: CostModel, stats: WorkloadStats, plan: Plan, opts: SearchOptions | None = None) -> Plan:
    """Re-predict an existing plan under new stats (for replan gain)."""
    o = opts or SearchOptions()
    t_roll = rollout_time(cm, stats, plan.buckets, o)
    t_train = _train_with_hybrid(
        cm, stats, plan.train_gpus, plan.train_tp, plan.hybrid_gpus, plan.buckets, t_roll, o
    )
    return Plan(plan.train_gpus, plan.train_tp, plan.buckets, plan.hybrid_gpus, t_train, t_roll)


__all__ = [
    "BucketPlan",
    "ClusterSpec",
    "Plan",
    "SearchOptions",
    "WorkloadStats",
    "best_layout",
    "evaluate",
    "rollout_time",
    "search",
    "train_time",
]
