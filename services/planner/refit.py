"""The live planner's replan loop, pure: what the scheduler and the trainer report in, a decision to
re-fit the buckets' token thresholds (or not) out.

The triggers (`ReplanPolicy`) and the re-fit itself (`refit_thresholds`) are the simulator's; this
only turns the live reports into their inputs: the scheduler's `WorkloadStats` (the output lengths
of recently launched trajectories, those still running counted as censored by `length_sample`,
tool seconds per call, prompt tokens, turns, queued turns) and the trainer's `TrainMetrics` (the
step time against the time between steps, i.e. the rollout/training balance). A threshold change
moves no worker, so its reconfiguration cost is zero; the predicted gain must still pass
`planner.min_gain`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.contracts import ev
from services.common.cost_model import CostModel
from services.common.runconfig import RunConfig
from services.policy.replan import EnginePool, ReplanPolicy, ReplanSignals, choose_refit, length_sample
from services.policy.search import BucketPlan, SearchOptions, WorkloadStats


@dataclass(frozen=True, slots=True)
class RefitDecision:
    trigger: str
    limits: list[float]
    """New token threshold per bucket, in the plan's order (the last is inf)."""
    current_s: float
    best_s: float
    layout: list[BucketPlan] | None = None
    """With `planner.relayout`: each bucket's TP and engines too, when moving engines predicts
    `min_gain` less rollout time than the thresholds alone (None: the engines stay)."""

    @property
    def gain(self) -> float:
        return (self.current_s - self.best_s) / self.current_s if self.current_s > 0 else 0.0


class LiveReplanner:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        p = cfg.planner
        preset = p.cost_model or cfg.rollout.emulated
        self.cm: CostModel = preset.costs()
        self.enabled = p.replan and cfg.rollout.policy == "cmlfq" and len(cfg.rollout.buckets) > 1
        self.policy = ReplanPolicy(interval_s=p.interval_s, cooldown_s=p.cooldown_s, min_gain=p.min_gain)
        self.stats: ev.WorkloadStats | None = None
        self.step_s = 0.0
        self.step_interval_s = 0.0
        self._last_step_at: float | None = None
        self._started: float | None = None

    def observe_workload(self, now: float, stats: ev.WorkloadStats) -> None:
        self.stats = stats
        if self._started is None:
            self._started = now

    def observe_step(self, now: float, m: ev.TrainMetrics) -> None:
        if m.step <= 0 or m.step_s <= 0:
            return
        if self._last_step_at is not None:
            self.step_interval_s = now - self._last_step_at
        self._last_step_at = now
        self.step_s = m.step_s

    def signals(self, replicas: dict[str, int]) -> ReplanSignals:
        assert self.stats is not None
        slots = max(1, sum(replicas.values()) * self.cfg.rollout.max_batch)
        queued = sum(self.stats.queued_turns_by_bucket.values())
        ratio = self.step_interval_s / self.step_s if self.step_s > 0 and self.step_interval_s > 0 else 1.0
        return ReplanSignals(queue_pressure=queued / slots, rejected=0, rollout_train_ratio=ratio)

    def decide(
        self,
        now: float,
        buckets: Sequence[ev.BucketSpec],
        replicas: dict[str, int],
        pool: EnginePool | None = None,
    ) -> RefitDecision | None:
        """A re-fit when the policy's triggers fire (its first interval counts from the first
        stats) and the best thresholds beat the current ones by `min_gain`; None otherwise. With
        `pool` (`planner.relayout`), a new layout of the pool's engines over the buckets when it
        beats the best thresholds alone by `min_gain` too."""
        s = self.stats
        if not self.enabled or s is None or len(s.trajectory_output_tokens) < self.cfg.planner.min_samples:
            return None
        if self.policy.last_replan is None and self._started is not None:
            self.policy.last_replan = self._started  # the first re-fit waits one interval of data
        fire, trigger = self.policy.should_replan(now, self.signals(replicas))
        if not fire:
            return None
        stats = WorkloadStats(
            trajectories_per_step=self.cfg.trajectories_per_step,
            output_tokens=length_sample(s.trajectory_output_tokens, s.running_output_tokens),
            mean_turns=max(1.0, s.turns_per_trajectory_mean),
            mean_tool_s=s.tool_s_per_turn / self._time_scale(),
            prompt_tokens=s.prompt_tokens,
        )
        plans = [
            BucketPlan(b.name, b.tensor_parallel, max(1, replicas.get(b.name, 0)), _limit(b)) for b in buckets
        ]
        opts = SearchOptions(max_seqs=self.cfg.rollout.max_batch, staleness=self.cfg.training.max_staleness)
        refit = choose_refit(self.cm, stats, plans, opts, self.policy, now, pool)
        if refit is None or refit.buckets is None:
            return None
        moved = [(b.tp, b.replicas) for b in refit.buckets] != [(b.tp, b.replicas) for b in plans]
        return RefitDecision(
            trigger,
            [b.max_tokens for b in refit.buckets],
            refit.current_s,
            refit.best_s,
            refit.buckets if moved else None,
        )

    def _time_scale(self) -> float:
        """Tool seconds are wall seconds; the cost model's are the hardware's (emulated runs)."""
        return self.cfg.rollout.emulated.time_scale if self.cfg.rollout.backend == "emulated" else 1.0


def _limit(b: ev.BucketSpec) -> float:
    return float(b.max_output_tokens) if b.max_output_tokens > 0 else math.inf
