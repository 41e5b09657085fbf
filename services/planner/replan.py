"""When to replan, and whether a new plan is worth its reconfiguration cost."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.cost_model import CostModel
from services.planner.search import BucketPlan, SearchOptions, WorkloadStats, rollout_time

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


def refit_thresholds(
    cm: CostModel, stats: WorkloadStats, buckets: Sequence[BucketPlan], opts: SearchOptions
) -> Refit:
    """Keeps the buckets (names, TPs, replicas) and tries every ordered choice of thresholds among
    `REFIT_QUANTILES` of the recent output lengths in `stats`, the last bucket taking the rest; the
    one with the lowest predicted rollout time wins. The simulator's replanner and the live
    planner both call this."""
    cur = rollout_time(cm, stats, buckets, opts)
    if len(buckets) < 2 or not stats.output_tokens:
        return Refit(cur, cur, None)
    xs = stats.output_tokens
    qs = sorted({xs[min(len(xs) - 1, int(q * len(xs)))] for q in REFIT_QUANTILES})
    best, best_t = None, cur
    for cut in itertools.combinations(qs, len(buckets) - 1):
        cand = [
            BucketPlan(b.name, b.tp, b.replicas, t) for b, t in zip(buckets, (*cut, math.inf), strict=True)
        ]
        t = rollout_time(cm, stats, cand, opts)
        if t < best_t:
            best, best_t = cand, t
    return Refit(cur, best_t, best)
