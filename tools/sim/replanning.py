"""Re-planning in the simulator: when the live planner's trigger fires (`ReplanPolicy`), the bucket
thresholds are re-fitted to the recent length distribution (`refit_thresholds`, the planner's own
code) and applied if the predicted gain is worth it. It keeps every decision for results.json."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.common.synthetic import TrajectorySpec, Workload
from services.planner.replan import ReplanPolicy, ReplanSignals, length_sample, refit_thresholds
from services.planner.search import SearchOptions, WorkloadStats
from tools.sim.kernel import Kernel


class Replanner:
    def __init__(self, sim: Kernel, policy: ReplanPolicy):
        self.sim = sim
        self.policy = policy
        self.replans: list[dict[str, Any]] = []

    def tick(self) -> None:
        """Re-fit bucket thresholds to the recent length distribution when a trigger fires."""
        sim, rp = self.sim, self.policy
        finished = [t.tokens for t in sim.recent if t.finished]
        if len(sim.sys.buckets) < 2 or len(finished) < sim.B * sim.wl.group_size:
            return
        slots = sum(e.max_seqs for e in sim.engines.values() if e.accepting) or 1
        last_train_s = sim.training.last_step_s
        ends = sim.step_ends
        interval = ends[-1] - ends[-2] if len(ends) > 1 else last_train_s
        ratio = interval / last_train_s if last_train_s else 1.0
        sig = ReplanSignals(sim.router.queued() / slots, 0, ratio)
        fire, reason = rp.should_replan(sim.now, sig)
        if not fire:
            return
        stats = self.workload_stats(length_sample(finished, [t.tokens for t in sim.recent if not t.finished]))
        refit = refit_thresholds(sim.cm, stats, sim.sys.buckets, SearchOptions(max_seqs=sim.sys.max_seqs))
        best, cur, best_t = refit.buckets, refit.current_s, refit.best_s
        applied = best is not None and rp.accept(sim.now, cur, best_t, 0.0)
        if not applied:
            rp.last_replan = sim.now
        self.replans.append({"t": sim.now, "reason": reason, "applied": applied, "pred_s": [cur, best_t]})
        if applied and best is not None and not sim.sys.pooled_routing:
            sim.sys.buckets = best
            sim.router.set_thresholds({b.name: b.max_tokens for b in best})

    def workload_stats(self, lengths: Sequence[float]) -> WorkloadStats:
        base = self.sim.sys.notes.get("profile")
        if isinstance(base, WorkloadStats):
            return WorkloadStats(
                base.trajectories_per_step,
                lengths,
                base.mean_turns,
                base.mean_tool_s,
                base.prompt_tokens,
                base.context_per_output,
            )
        return workload_stats(self.sim.wl, lengths)


def workload_stats(
    w: Workload, lengths: Sequence[float], specs: list[TrajectorySpec] | None = None
) -> WorkloadStats:
    """Planner input from finished lengths (live) or sampled trajectories (profiling)."""
    if specs:
        out = sum(s.output_tokens for s in specs) / len(specs)
        ctx = sum(s.context_tokens - s.prompt_tokens for s in specs) / len(specs)
        turns = sum(len(s.turns) for s in specs) / len(specs)
        tool = sum(s.tool_time_s for s in specs) / max(1.0, sum(len(s.turns) - 1 for s in specs))
        prompt = sum(s.prompt_tokens for s in specs) / len(specs)
        lengths = [s.output_tokens for s in specs]
        return WorkloadStats(
            w.prompts_per_step * w.group_size, lengths, turns, tool, prompt, ctx / max(1.0, out)
        )
    return WorkloadStats(w.prompts_per_step * w.group_size, lengths, w.max_turns / 2, 5.0, 2000.0, 2.0)
