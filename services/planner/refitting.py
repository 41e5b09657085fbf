"""Re-fits under the plan: when a trigger fires, the buckets' thresholds re-fitted to the live
workload, and with `planner.relayout` the engines moved between buckets (and the buckets' TP),
as the replanner decides (`refit.py`, by simulating its candidates)."""

from __future__ import annotations

import asyncio
import math
import time

from services.common.logging import get_logger
from services.common.membership import SPARE_ROLE
from services.common.metrics import planner_metrics
from services.common.runconfig import RunConfig
from services.planner.plan_state import PlanState
from services.planner.refit import LiveReplanner, RefitDecision
from services.planner.roles import RoleMoves
from services.policy.assign import Slot
from services.policy.replan import EnginePool, assign_layout


class Refitting:
    def __init__(self, cfg: RunConfig, state: PlanState, moves: RoleMoves):
        self.cfg, self.state, self.moves = cfg, state, moves
        self.replanner = LiveReplanner(cfg)
        self.log = get_logger(component="planner")

    async def maybe_refit(self) -> None:
        """New bucket thresholds when a trigger fires and the gain is worth it; with
        `planner.relayout`, the engines moved between buckets (and the buckets' TP) too when that
        is worth more."""
        s = self.state
        replicas = {b.name: 0 for b in s.buckets}
        for slot in s.slots.values():
            if slot.role == "rollout" and slot.bucket in replicas:
                replicas[slot.bucket] += 1
        pool = self._engine_pool()
        before = self.replanner.last_what_if
        # Simulating candidates takes up to planner.what_if.budget_s: off the event loop, so leases
        # and heartbeats keep going (nothing else touches the replanner meanwhile but its inputs).
        decision = await asyncio.to_thread(self.replanner.decide, time.monotonic(), s.buckets, replicas, pool)
        what_if = self.replanner.last_what_if
        if what_if is not None and what_if is not before:
            planner_metrics().decision_s.observe(what_if.decision_s)
            self.log.info("replan_simulated", **what_if.record())
        if decision is None:
            return
        for b, limit in zip(s.buckets, decision.limits, strict=True):
            b.max_output_tokens = 0 if math.isinf(limit) else int(limit)
        s.changed(f"replan:{decision.trigger}", decision.gain, decision.what_if)
        self.log.info(
            "buckets_refit",
            trigger=decision.trigger,
            thresholds={b.name: b.max_output_tokens for b in s.buckets},
            layout={b.name: f"{b.replicas}xTP{b.tp}" for b in decision.layout or []},
            predicted_gain=round(decision.gain, 4),
            predicted_rollout_s=[round(decision.current_s, 1), round(decision.best_s, 1)],
        )
        if decision.layout is not None:
            assert pool is not None  # a layout is decided only over a pool
            await self._relayout(decision, pool)

    def _engine_pool(self) -> EnginePool | None:
        """The engines a re-layout may move (`planner.relayout`): those serving a bucket and those a
        re-layout left spare, with the GPUs they stand for (an emulated engine its bucket's TP, a
        spare what it kept)."""
        if not self.cfg.planner.relayout:
            return None
        s = self.state
        tp = {b.name: b.tensor_parallel for b in s.buckets}
        serving = [slot for slot in s.slots.values() if slot.role == "rollout" and slot.bucket in tp]
        spares = [slot for slot in s.slots.values() if slot.role == SPARE_ROLE]
        gpus = sum(tp[slot.bucket] for slot in serving) + sum(slot.tensor_parallel for slot in spares)
        return EnginePool(len(serving) + len(spares), gpus, fixed_tp=self.cfg.rollout.backend != "emulated")

    async def _relayout(self, decision: RefitDecision, pool: EnginePool) -> None:
        """Moves engines to the decision's layout under one plan (`assign_layout`: a bucket with
        more engines than it needs gives its last ones to one that needs more, or leaves them
        spare; spares are taken first; with fixed TPs an engine only goes to a bucket of its TP)."""
        assert decision.layout is not None
        s = self.state
        old_tp = {b.name: b.tensor_parallel for b in s.buckets}
        slots = {
            slot.worker_id: slot
            for slot in s.slots.values()
            if slot.role == "rollout" and slot.bucket in old_tp
        }
        spares = {slot.worker_id: slot for slot in s.slots.values() if slot.role == SPARE_ROLE}
        members: dict[str, list[tuple[str, int]]] = {name: [] for name in old_tp}
        for slot in slots.values():
            members[slot.bucket].append((slot.worker_id, old_tp[slot.bucket]))
        target = assign_layout(
            members,
            [(slot.worker_id, slot.tensor_parallel) for slot in spares.values()],
            decision.layout,
            pool.gpus,
            pool.fixed_tp,
        )
        for spec in s.buckets:
            spec.tensor_parallel = next(b.tp for b in decision.layout if b.name == spec.name)
        moves: list[tuple[Slot, str, str]] = []
        for worker_id, (bucket, tp) in target.items():
            slot = slots.get(worker_id) or spares[worker_id]
            if not bucket:  # the GPUs the layout does not use stay with the spares
                if slot.role != SPARE_ROLE:
                    moves.append((slot, SPARE_ROLE, ""))
            elif slot.role == SPARE_ROLE or slot.bucket != bucket or old_tp[slot.bucket] != tp:
                moves.append((slot, "rollout", bucket))  # another bucket, or the same at another TP
            slot.tensor_parallel = tp
        if moves:
            layout = ",".join(f"{b.name}={b.replicas}xTP{b.tp}" for b in decision.layout)
            await self.moves.apply(moves, "relayout", f"replan:{decision.trigger}:relayout:{layout}")
