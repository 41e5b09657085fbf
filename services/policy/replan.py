"""When to replan, and whether a new plan is worth its reconfiguration cost."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.cost_model import CostModel
from services.policy.search import BucketPlan, SearchOptions, WorkloadStats, bucket_time, rollout_time

REFIT_QUANTILES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
"""Candidate bucket thresholds: these quantiles of recent trajectories' output tokens."""


def length_sample(finished: Sequence[float], running: Sequence[float] = ()) -> list[float]:
    """Trajectory output lengths for the re-fit, corrected for the ones still running.

    `finished` and `running` are one cohort (the most recently launched trajectories): the final
    lengths of those that ended, and the lengths so far of those still generating (or cut short),
    which are lower bounds of their final lengths. Short trajectories finish first, so the finished
    ones alone under-state the lengths early in a run and after a change in the workload. The
    Kaplan-Meier estimate treats each running one as right-censored: its share goes to the finished
    lengths above its length so far. Returns one length per cohort member, at evenly spaced
    quantiles of that estimate; the share left above the longest finished length (every trajectory
    that long is still running) sits at the longest running length, a lower bound.
    """
    obs = sorted([(float(x), 0) for x in finished] + [(float(x), 1) for x in running])
    if not obs:
        return []
    at_risk, surv, mass = len(obs), 1.0, []
    for value, group in itertools.groupby(obs, key=lambda o: o[0]):
        kinds = [k for _, k in group]
        ended = kinds.count(0)
        if ended:
            share = surv * ended / at_risk
            mass.append((value, share))
            surv -= share
        at_risk -= len(kinds)
    if surv > 1e-12:
        mass.append((obs[-1][0], surv))
    n, out, acc, i = len(obs), [], 0.0, 0
    for k in range(n):
        p = (k + 0.5) / n
        while i < len(mass) - 1 and acc + mass[i][1] < p:
            acc += mass[i][1]
            i += 1
        out.append(mass[i][0])
    return out


@dataclass(frozen=True, slots=True)
class ReplanSignals:
    """Metrics a planner sees: queued turns per rollout slot, rejected requests since the last
    plan, and the measured rollout/train time ratio of recent steps."""

    queue_pressure: float = 0.0
    rejected: int = 0
    rollout_train_ratio: float = 1.0


@dataclass(slots=True)
class ReplanPolicy:
    interval_s: float = 600.0
    cooldown_s: float = 120.0
    queue_pressure_high: float = 2.0
    rejected_high: int = 1
    ratio_band: tuple[float, float] = (0.8, 1.25)
    horizon_steps: int = 5
    """A new plan must repay its reconfiguration cost within this many steps."""
    min_gain: float = 0.03
    """...and predict at least this fractional step-time reduction."""
    last_replan: float | None = None

    def should_replan(self, now: float, signals: ReplanSignals) -> tuple[bool, str]:
        """A trigger fires (interval, queue pressure, rejections, stage imbalance) outside the cooldown."""
        if self.last_replan is not None and now - self.last_replan < self.cooldown_s:
            return False, "cooldown"
        if self.last_replan is None or now - self.last_replan >= self.interval_s:
            return True, "interval"
        if signals.queue_pressure >= self.queue_pressure_high:
            return True, "queue_pressure"
        if signals.rejected >= self.rejected_high:
            return True, "rejected"
        lo, hi = self.ratio_band
        if not lo <= signals.rollout_train_ratio <= hi:
            return True, "imbalance"
        return False, "steady"

    def accept(self, now: float, current_step_s: float, new_step_s: float, reconfig_s: float) -> bool:
        """Apply only if the predicted gain over the horizon beats the reconfiguration cost.

        Evaluating a candidate starts the cooldown whether or not it is applied, so a planner that
        keeps finding marginal plans does not thrash.
        """
        self.last_replan = now
        gain = current_step_s - new_step_s
        if gain <= self.min_gain * current_step_s:
            return False
        return gain * self.horizon_steps > reconfig_s


@dataclass(frozen=True, slots=True)
class Refit:
    """The outcome of re-fitting bucket thresholds: the predicted rollout time of the current
    buckets and of the best candidate, which is None when no candidate beats the current ones."""

    current_s: float
    best_s: float
    buckets: list[BucketPlan] | None

    @property
    def gain(self) -> float:
        """Predicted fractional reduction of the rollout time."""
        return (self.current_s - self.best_s) / self.current_s if self.current_s > 0 else 0.0


def refit_quantiles(stats: WorkloadStats) -> list[float]:
    """The thresholds a re-fit chooses among: `REFIT_QUANTILES` of the recent output lengths."""
    xs = stats.output_tokens
    return sorted({xs[min(len(xs) - 1, int(q * len(xs)))] for q in REFIT_QUANTILES})


def threshold_candidates(
    cm: CostModel, stats: WorkloadStats, buckets: Sequence[BucketPlan], opts: SearchOptions
) -> list[tuple[float, list[BucketPlan]]]:
    """Every ordered choice of thresholds among `REFIT_QUANTILES` of the recent output lengths, the
    last bucket taking the rest, with its predicted rollout time, fastest first (ties: in the
    order tried)."""
    if len(buckets) < 2 or not stats.output_tokens:
        return []
    qs = refit_quantiles(stats)
    out = []
    for cut in itertools.combinations(qs, len(buckets) - 1):
        cand = [
            BucketPlan(b.name, b.tp, b.replicas, t) for b, t in zip(buckets, (*cut, math.inf), strict=True)
        ]
        out.append((rollout_time(cm, stats, cand, opts), cand))
    out.sort(key=lambda tc: tc[0])
    return out


def refit_thresholds(
    cm: CostModel, stats: WorkloadStats, buckets: Sequence[BucketPlan], opts: SearchOptions
) -> Refit:
    """Keeps the buckets (names, TPs, replicas) and tries every ordered choice of thresholds among
    `REFIT_QUANTILES` of the recent output lengths in `stats`, the last bucket taking the rest; the
    one with the lowest predicted rollout time wins. The simulator's replanner and the live
    planner both call this."""
    cur = rollout_time(cm, stats, buckets, opts)
    ranked = threshold_candidates(cm, stats, buckets, opts)
    if not ranked or ranked[0][0] >= cur:
        return Refit(cur, cur, None)
    return Refit(cur, ranked[0][0], ranked[0][1])


@dataclass(frozen=True, slots=True)
class EnginePool:
    """The engines a re-layout may move between buckets.

    `engines` engine processes standing for `gpus` GPUs. With `fixed_tp` (real engines: an
    engine's TP is set when it starts) an engine moves only between buckets of its own TP, and the
    count per TP stays; otherwise (emulated engines adopt their bucket's TP) any engine may serve
    any bucket as long as the buckets' GPUs fit in `gpus` (an engine left over serves nothing)."""

    engines: int
    gpus: int
    fixed_tp: bool = False


def refit_layout(
    cm: CostModel, stats: WorkloadStats, buckets: Sequence[BucketPlan], opts: SearchOptions, pool: EnginePool
) -> Refit:
    """Like `refit_thresholds`, but the engines too: every ordered choice of thresholds among
    `REFIT_QUANTILES`, and, unless the pool's TPs are fixed, every TP per bucket from
    `opts.bucket_tps` (not decreasing from the first bucket to the last, as the planner lays
    buckets out), each with the split of the pool's engines between the buckets (each keeps one at
    least, within the pool's engines and GPUs) that gives the lowest predicted rollout time. Of
    equal times, the one using the most GPUs wins, then the one moving fewest engines. The buckets
    keep their names.

    A bucket's time depends only on its own TP, engines and thresholds, and the rollout time is the
    slowest bucket's: for a time T each bucket needs the fewest engines that finish it within T, so
    the lowest T whose needs fit the pool is found by bisection over the buckets' times
    (`_fewest_engines`), and the engines left over then go where they use the most GPUs."""
    cur = rollout_time(cm, stats, buckets, opts)
    if len(buckets) < 2 or not stats.output_tokens:
        return Refit(cur, cur, None)
    qs = refit_quantiles(stats)
    old_tps = tuple(b.tp for b in buckets)
    old = [b.replicas for b in buckets]
    if pool.fixed_tp:
        tp_choices = [old_tps]
    else:
        menu = sorted({*opts.bucket_tps, *old_tps})
        tp_choices = list(itertools.combinations_with_replacement(menu, len(buckets)))
    most = max(1, (sum(old) if pool.fixed_tp else pool.engines) - len(buckets) + 1)
    best: tuple[float, int, int] | None = None
    best_t, chosen = cur, None
    rows: dict[tuple[int, float, float], list[float]] = {}

    def row(tp: int, lo: float, hi: float) -> list[float]:
        """A bucket's time with 0..most engines of `tp` for the lengths in (lo, hi]."""
        if (tp, lo, hi) not in rows:
            plans = (BucketPlan("", tp, r, hi) for r in range(1, most + 1))
            rows[tp, lo, hi] = [math.inf] + [bucket_time(cm, stats, p, lo, opts) for p in plans]
        return rows[tp, lo, hi]

    for tps in tp_choices:
        for cut in itertools.combinations(qs, len(buckets) - 1):
            limits = (*cut, math.inf)
            table = [row(tp, lo, hi) for tp, lo, hi in zip(tps, (-math.inf, *cut), limits, strict=True)]
            split = _fewest_engines(table, tps, old, pool)
            if split is None:
                continue
            t = max(table[i][r] for i, r in enumerate(split)) * opts.rollout_scale
            if t >= cur * (1 - 1e-9):
                continue
            moved = sum(
                r if tp != o_tp else abs(r - o)
                for r, o, tp, o_tp in zip(split, old, tps, old_tps, strict=True)
            )
            key = (round(t, 6), -sum(tp * r for tp, r in zip(tps, split, strict=True)), moved)
            if best is None or key < best:
                best, best_t = key, t
                chosen = [
                    BucketPlan(b.name, tp, r, h)
                    for b, tp, r, h in zip(buckets, tps, split, limits, strict=True)
                ]
    return Refit(cur, best_t, chosen)


def _fewest_engines(
    table: Sequence[Sequence[float]], tps: Sequence[int], old: Sequence[int], pool: EnginePool
) -> list[int] | None:
    """Engines per bucket with the lowest slowest-bucket time the pool allows (`table[b][r]`: bucket
    b's time with r engines), then the rest of the pool placed where it uses the most GPUs (a
    bucket taking one more only if that keeps it within that time; with fixed TPs every engine
    serves a bucket of its TP), each to the bucket furthest below its `old` engines. None: nothing
    fits."""
    classes: dict[int, list[int]] = {}
    for i, tp in enumerate(tps):
        classes.setdefault(tp, []).append(i)
    have = {tp: sum(old[i] for i in idx) for tp, idx in classes.items()}

    def needs(limit: float) -> list[int] | None:
        out = []
        for row in table:
            r = next((r for r in range(1, len(row)) if row[r] <= limit), None)
            if r is None:
                return None
            out.append(r)
        return out

    def fits(split: list[int]) -> bool:
        if pool.fixed_tp:
            return all(sum(split[i] for i in idx) <= have[tp] for tp, idx in classes.items())
        return sum(split) <= pool.engines and sum(t * r for t, r in zip(tps, split, strict=True)) <= pool.gpus

    times = sorted({x for row in table for x in row[1:] if not math.isinf(x)})
    lo, hi, found = 0, len(times) - 1, None
    while lo <= hi:  # the lowest time whose needs fit (needs shrink as the time grows)
        mid = (lo + hi) // 2
        cand = needs(times[mid])
        if cand is not None and fits(cand):
            found, hi = cand, mid - 1
        else:
            lo = mid + 1
    if found is None:
        return None
    split = found
    limit = max(table[i][r] for i, r in enumerate(split))

    def room(i: int) -> bool:
        return split[i] + 1 < len(table[i]) and table[i][split[i] + 1] <= limit

    if pool.fixed_tp:
        for tp, idx in classes.items():
            for _ in range(have[tp] - sum(split[i] for i in idx)):  # every engine of the TP serves
                split[max(idx, key=lambda i: (room(i), old[i] - split[i], -i))] += 1
        return split
    for tp in sorted(classes, reverse=True):  # the biggest engines first: the most GPUs used
        while True:
            open_ = [i for i in classes[tp] if room(i)]
            if not open_:
                break
            pick = max(open_, key=lambda i: (old[i] - split[i], -i))
            if not fits([r + (i == pick) for i, r in enumerate(split)]):
                break
            split[pick] += 1
    return split


def by_id(worker_id: str) -> tuple[str, int]:
    """Orders worker ids by name, then number (rollout-engine-2 before rollout-engine-10)."""
    head = worker_id.rstrip("0123456789")
    tail = worker_id[len(head) :]
    return head, int(tail) if tail else -1


def assign_layout(
    members: Mapping[str, Sequence[tuple[str, int]]],
    spares: Sequence[tuple[str, int]],
    layout: Sequence[BucketPlan],
    gpus: int,
    fixed_tp: bool = False,
) -> dict[str, tuple[str, int]]:
    """Where each engine goes when `layout` is applied: engine id -> (bucket, TP), a spare as
    ("", the GPUs it keeps). `members`: each bucket's engines (id, TP) now; `spares`: the engines
    serving nothing (id, GPUs kept); `gpus`: what they all stand for.

    A bucket keeps its first engines (by `by_id`) and gives its surplus to the buckets, in the
    layout's order, short of engines, spares first; with `fixed_tp` (real engines) an engine
    only goes to a bucket of its own TP. Engines left over are spares and keep, between them, the
    GPUs the layout leaves unused. Every engine is in the answer, in the order it is placed (each
    bucket's kept engines, then the ones it is given; then the spares). The live planner and the
    simulator's re-planner both apply this."""
    free = sorted(spares, key=lambda e: by_id(e[0]))
    kept: dict[str, list[tuple[str, int]]] = {}
    for b in layout:
        own = sorted(members.get(b.name, ()), key=lambda e: by_id(e[0]))
        kept[b.name] = own[: b.replicas]
        free += own[b.replicas :]
    out: dict[str, tuple[str, int]] = {}
    for b in layout:
        placed = list(kept[b.name])
        while len(placed) < b.replicas:
            fits = [e for e in free if not fixed_tp or e[1] == b.tp]
            if not fits:
                break
            free.remove(fits[0])
            placed.append(fits[0])
        out.update((e, (b.name, b.tp)) for e, _ in placed)
    left = gpus - sum(tp for bucket, tp in out.values())  # what the placed engines do not use
    for i, (e, _) in enumerate(free):
        out[e] = ("", left // len(free) + (i < left % len(free)))
    return out


def restart_s(cm: CostModel, old: Sequence[BucketPlan], new: Sequence[BucketPlan]) -> float:
    """What a re-layout costs before it pays: engines given another TP restart and load the
    weights (in parallel: the slowest one's `engine_load_s`); a move between buckets is free."""
    changed = [b.tp for a, b in zip(old, new, strict=True) if a.tp != b.tp]
    return max((cm.engine_load_s(tp) for tp in changed), default=0.0)


def choose_refit(
    cm: CostModel,
    stats: WorkloadStats,
    buckets: Sequence[BucketPlan],
    opts: SearchOptions,
    policy: ReplanPolicy,
    now: float,
    pool: EnginePool | None = None,
) -> Refit | None:
    """What a fired trigger applies, or None: the best thresholds (`refit_thresholds`) if they beat
    the current ones by the policy's `min_gain`; with `pool`, the best layout of its engines
    (`refit_layout`) instead when it beats those thresholds by `min_gain` too and repays its
    restarts (`restart_s`) within the policy's horizon. Evaluating starts the policy's cooldown
    either way. The live planner and the simulator's re-planner both call this."""
    refit = refit_thresholds(cm, stats, buckets, opts)
    if pool is not None:
        layout = refit_layout(cm, stats, buckets, opts, pool)
        if (
            layout.buckets is not None
            and layout.best_s < refit.best_s * (1 - policy.min_gain)
            and policy.accept(now, layout.current_s, layout.best_s, restart_s(cm, buckets, layout.buckets))
        ):
            return layout
    if refit.buckets is None or not policy.accept(now, refit.current_s, refit.best_s, 0.0):
        policy.last_replan = now
        return None
    return refit
