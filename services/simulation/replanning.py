"""Re-planning in the simulator: when the live planner's trigger fires (`ReplanPolicy`), the bucket
thresholds are re-fitted to the recent length distribution and, with `relayout`, the engines are
laid out over the buckets again (`choose_refit`, the planner's own code), and applied if the
predicted gain is worth it. It keeps every decision for results.json."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.common.synthetic import TrajectorySource, TrajectorySpec
from services.policy.replan import (
    EnginePool,
    ReplanPolicy,
    ReplanSignals,
    assign_layout,
    by_id,
    choose_refit,
    length_sample,
)
from services.policy.search import BucketPlan, SearchOptions, WorkloadStats
from services.simulation.engine import Engine
from services.simulation.fleet import Members
from services.simulation.kernel import Kernel
from services.simulation.ledger import Meter, book_engine


class Replanner:
    def __init__(self, sim: Kernel, policy: ReplanPolicy):
        self.sim = sim
        self.policy = policy
        self.replans: list[dict[str, Any]] = []
        self.spares: list[Engine] = []
        """Engines a re-layout left without a bucket (closed; their GPUs are in `spare`)."""
        self.spare = Meter(sim.ledger, 0)
        """The GPUs a re-layout left unused, idle."""
        self.restarts = 0

    def tick(self) -> None:
        """Re-fit bucket thresholds (and, with `relayout`, the engines' layout) to the recent
        length distribution when a trigger fires."""
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
        relayout = sim.sys.relayout and not sim.sys.pooled_routing
        current = [
            BucketPlan(
                b.name, b.tp, max(1, len(self._members(b.name))) if relayout else b.replicas, b.max_tokens
            )
            for b in sim.sys.buckets
        ]
        opts = SearchOptions(
            max_seqs=sim.sys.max_seqs,
            staleness=sim.sys.staleness if sim.sys.mode == "async" or sim.sys.partial_rollout else 0,
        )
        refit = choose_refit(sim.cm, stats, current, opts, rp, sim.now, self._pool() if relayout else None)
        best = refit.buckets if refit is not None else None
        moved = best is not None and [(b.tp, b.replicas) for b in best] != [
            (b.tp, b.replicas) for b in current
        ]
        self.replans.append(
            {
                "t": sim.now,
                "reason": reason,
                "applied": best is not None,
                "relayout": moved,
                "pred_s": [refit.current_s, refit.best_s] if refit is not None else None,
            }
        )
        if best is None or sim.sys.pooled_routing:
            return
        if moved:
            self._relayout(best)
        sim.sys.buckets = best
        sim.router.set_thresholds({b.name: b.max_tokens for b in best})

    def close(self, end: float) -> None:
        self.spare.set(None, end)

    # ---- re-layout: the live planner's moves, on the simulated engines ---------------------------

    def _members(self, bucket: str) -> list[Engine]:
        """The bucket's own engines (not the hybrid workers, not the lent ones, not spares), by id."""
        sim = self.sim
        other = {*sim.hybrid.meters, *(e.engine_id for e in sim.training.lent)}
        spare = {e.engine_id for e in self.spares}
        out = [
            e
            for e in sim.engines.values()
            if e.bucket == bucket and e.engine_id not in other and e.engine_id not in spare
        ]
        return sorted(out, key=lambda e: by_id(e.engine_id))

    def _pool(self) -> EnginePool:
        engines = [e for b in self.sim.sys.buckets for e in self._members(b.name)]
        return EnginePool(len(engines) + len(self.spares), sum(e.tp for e in engines) + self.spare.gpus)

    def _relayout(self, layout: list[BucketPlan]) -> None:
        """As the live planner applies a layout (`PlannerService._relayout`): a bucket's surplus
        engines (its last ones) and the spares fill the buckets short of engines; an engine that
        changes TP restarts (its turns stop with their tokens and continue elsewhere, and it loads
        the weights at the new TP); an engine moving between buckets at its TP keeps its turns;
        engines left over become spares, and the GPUs the layout does not use idle in `spare`."""
        sim = self.sim
        total = self._pool().gpus
        engines = {e.engine_id: e for e in self.spares}
        members: dict[str, list[tuple[str, int]]] = {}
        for b in layout:
            own = self._members(b.name)
            engines.update((e.engine_id, e) for e in own)
            members[b.name] = [(e.engine_id, e.tp) for e in own]
        spares = [(e.engine_id, e.tp) for e in self.spares]
        stopped: list[str] = []
        for engine_id, (bucket, tp) in assign_layout(members, spares, layout, total).items():
            e = engines[engine_id]
            if not bucket:
                if e not in self.spares:
                    stopped += self._stop(e)
                    sim.by_bucket[sim.key(e.bucket)].remove(e)
                    self.spares.append(e)
            elif e in self.spares:
                self.spares.remove(e)
                self._move(e, bucket)
                self._open(e, tp)
            elif e.tp != tp:
                stopped += self._restart(e, bucket, tp)
            else:
                self._move(e, bucket)
        self.spare.set(None, sim.now)
        self.spare.gpus = total - sum(b.tp * b.replicas for b in layout)
        self.spare.set("rollout_idle", sim.now)
        for tid in stopped:
            sim.start_turn(tid)
        for e in sim.engines.values():
            if sim.serving(e):
                sim.fill(e)
                sim.wake(e)

    def _move(self, e: Engine, bucket: str) -> None:
        sim = self.sim
        if e.bucket == bucket:
            return
        if e in sim.by_bucket.get(sim.key(e.bucket), []):
            sim.by_bucket[sim.key(e.bucket)].remove(e)
        e.bucket = bucket
        sim.by_bucket.setdefault(sim.key(bucket), Members()).append(e)

    def _stop(self, e: Engine) -> list[str]:
        """The engine stops: its turns stop with their tokens, its GPU-time so far is booked."""
        sim = self.sim
        stopped = sim.training.evict(e)
        e.close(sim.now)
        book_engine(sim.ledger, e, restart=True)
        return stopped

    def _open(self, e: Engine, tp: int) -> None:
        """The engine starts at `tp`: it loads the current weights at that TP first."""
        sim = self.sim
        e.tp = tp
        e.kv_capacity = sim.cm.kv_capacity_tokens(tp)
        e.stale = True
        sim.draining.discard(e.engine_id)
        e.open(sim.now)
        e.load_weights(sim.now, sim.cm.engine_load_s(tp), sim.version)
        self.restarts += 1

    def _restart(self, e: Engine, bucket: str, tp: int) -> list[str]:
        stopped = self._stop(e)
        self._move(e, bucket)
        self._open(e, tp)
        return stopped

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
    w: TrajectorySource, lengths: Sequence[float], specs: list[TrajectorySpec] | None = None
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
