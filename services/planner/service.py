"""The planner's service shell: registers workers with leased, fenced ownership in Redis,
re-fits the buckets to the live workload, and publishes the plan (durably, on JetStream) whenever
it changes.

The planner holds a lease of its own (`role:planner`); its fencing token is the plan's
`planner_epoch`. It records every plan in the run's plan history (Redis) under that lease before
publishing it, so a planner that lost its lease publishes nothing, and workers refuse a plan from
an older epoch than one they already follow.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from typing import Any

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.config import CommonSettings, load_settings
from services.common.contracts import ev
from services.common.credentials import TRAINER_ENGINE_SUFFIX
from services.common.errors import require
from services.common.logging import get_logger
from services.common.membership import (
    HYBRID_ROLE,
    LENT_ROLE,
    PARKED_ROLE,
    SPARE_ROLE,
    TRAINER_ROLE,
    lease_resource,
)
from services.common.metrics import planner_metrics
from services.common.ownership import Lease, OwnershipStore
from services.common.runconfig import RunConfig
from services.common.tracing import tracer
from services.planner.config import PlannerSettings
from services.planner.elastic import LivePool
from services.planner.history import PLANNER_ROLE, PlanHistory
from services.planner.refit import LiveReplanner, RefitDecision
from services.policy.assign import ROLE_BY_KIND, Slot, StaticAssigner
from services.policy.replan import EnginePool, assign_layout

MOVABLE_ROLES = ("rollout", "draining", "hybrid")
"""Roles an operator (or, next, the planner itself) may move an engine between: serving a bucket,
out of rollout, or in the trainer's data-parallel group (the hybrid pool)."""


class PlannerService:
    def __init__(
        self,
        settings: PlannerSettings,
        cfg: RunConfig,
        bus: Bus,
        store: OwnershipStore,
        worker_id: str = "planner",
    ):
        self.settings, self.cfg, self.bus, self.store = settings, cfg, bus, store
        self.worker_id = worker_id
        self.assigner = StaticAssigner(
            [b.name for b in cfg.rollout.buckets],
            cfg.bucket_engines,
            # vLLM's TP is fixed when it starts: it serves a bucket of that TP
            {b.name: b.tensor_parallel for b in cfg.rollout.buckets}
            if cfg.rollout.backend == "vllm"
            else None,
        )
        self.slots: dict[str, Slot] = {}
        self.version = 0
        self.dirty = False
        self.lease: Lease | None = None
        self.buckets = [
            ev.BucketSpec(
                name=b.name,
                tensor_parallel=b.tensor_parallel,
                max_context_tokens=b.max_context_tokens,
                max_output_tokens=b.max_output_tokens or 0,
            )
            for b in cfg.rollout.buckets
        ]
        self.reason, self.gain = "static", 0.0
        self.decision: dict[str, object] | None = None
        """What the re-fit in the next plan simulated (`WhatIf.record`), for its plan record."""
        self.replanner = LiveReplanner(cfg)
        self.pool = LivePool(cfg)
        self.history = PlanHistory(bus, store)
        self._history = asyncio.Lock()
        """Orders the role history: a change is recorded before the steps its plan sets off."""
        self.log = get_logger(component="planner")

    async def start(self) -> None:
        await self.bus.bind_stream("PLAN")
        await self.history.start()
        last = await self.bus.last_message(subjects.PLAN, "PLAN", ev.Plan)
        if last is not None:  # a restarted planner continues the plan, and its version numbers
            self.version = last.plan_version
            for a in last.assignments:
                self.slots[a.worker_id] = Slot(
                    a.worker_id, "", a.role, a.bucket, a.weight_sync_addr, a.tensor_parallel, a.fencing_token
                )
            if [b.name for b in last.buckets] == [b.name for b in self.buckets]:
                self.buckets = [ev.BucketSpec.FromString(b.SerializeToString()) for b in last.buckets]
        await self.bus.subscribe(subjects.WORKER_HELLO, ev.WorkerHello, self._on_hello)
        await self.bus.subscribe(subjects.WORKLOAD_STATS, ev.WorkloadStats, self._on_workload)
        await self.bus.subscribe(subjects.TRAIN_METRICS, ev.TrainMetrics, self._on_train_metrics)
        await self.bus.subscribe(subjects.ROLE_REQUEST, ev.RoleChange, self._on_role_request)
        await self.bus.subscribe(subjects.LEND_REQUEST, ev.LendRequest, self._on_lend_request)
        await self.bus.subscribe(subjects.HYBRID_STATE, ev.HybridState, self._on_hybrid_state)
        self.bus.spawn(self._loop())

    async def _on_role_request(self, req: ev.RoleChange, _: Envelope) -> ev.RoleChange:
        """Moves an engine between rollout buckets, or out of rollout (`draining`: it hands its
        turns back and takes no new ones) and back. Answers with the change as applied, under the
        worker's fencing token; the plan goes out at once and the change on `plan.role_change`."""
        require(self.lease is not None, "this planner does not hold the planner lease")
        slot = self.slots.get(req.worker_id)
        require(slot is not None, f"unknown worker {req.worker_id!r}")
        assert slot is not None
        require(
            slot.role in MOVABLE_ROLES and req.to_role in MOVABLE_ROLES,
            f"only engines move between {'/'.join(MOVABLE_ROLES)} ({req.worker_id} is {slot.role!r})",
        )
        names = [b.name for b in self.buckets]
        bucket = req.bucket or slot.bucket
        require(req.to_role != "rollout" or bucket in names, f"unknown bucket {bucket!r}; known: {names}")
        change = await self._move(slot, req.to_role, bucket, "role_change")
        require(change is not None, "the planner lost its lease before publishing the change")
        assert change is not None
        return change

    async def _move(self, slot: Slot, to_role: str, bucket: str, why: str) -> ev.RoleChange | None:
        """Applies a role change to the plan and publishes both (None: the lease was lost first)."""
        changes = await self._move_all([slot], to_role, bucket, why)
        return changes[0] if changes else None

    async def _move_all(
        self, slots: list[Slot], to_role: str, bucket: str, why: str
    ) -> list[ev.RoleChange] | None:
        """Moves every slot to `to_role` in `bucket` under one plan, then announces each change
        (None: the lease was lost before the plan went out)."""
        return await self._apply_moves([(slot, to_role, bucket) for slot in slots], why)

    async def _apply_moves(
        self, moves: list[tuple[Slot, str, str]], why: str, reason: str = ""
    ) -> list[ev.RoleChange] | None:
        """Applies each (slot, role, bucket) under one plan (`reason`, or one naming the moves),
        records the changes in the role history, then announces each (None: the lease was lost
        before the plan went out)."""
        changes = []
        for slot, to_role, bucket in moves:
            change = ev.RoleChange(
                worker_id=slot.worker_id,
                from_role=slot.role,
                to_role=to_role,
                bucket=bucket,
                fencing_token=slot.fencing_token,
            )
            attrs: dict[str, Any] = {
                "libra.worker_id": slot.worker_id,
                "libra.from_role": slot.role,
                "libra.to_role": to_role,
                "libra.why": why,
                "libra.fencing_token": slot.fencing_token,
            }
            tracer().start_span("plan.role_change", attributes=attrs).end()
            slot.role, slot.bucket = to_role, bucket
            changes.append(change)
        names = ",".join(s.worker_id for s, _, _ in moves)
        self.reason = reason or (
            f"{why}:{names}:{changes[0].from_role}->{changes[0].to_role}" if changes else why
        )
        self.dirty = True
        async with self._history:  # the workers' first steps, which may come at once, go after it
            if not await self._publish():
                return None
            for change, (slot, _, _) in zip(changes, moves, strict=True):
                await self._record_role_change(
                    {
                        "worker": change.worker_id,
                        "from": change.from_role,
                        "to": change.to_role,
                        "bucket": change.bucket,
                        "tp": slot.tensor_parallel,
                        "why": why,
                    }
                )
        for change in changes:
            await self.bus.publish(subjects.ROLE_CHANGE, change)
            self.log.info(
                "role_changed",
                worker_id=change.worker_id,
                source=change.from_role,
                target=change.to_role,
                bucket=change.bucket,
                why=why,
            )
        return changes

    async def _on_lend_request(self, req: ev.LendRequest, _: Envelope) -> ev.LendReply:
        """The trainer waits for its batch (`lend`: every parked engine on its GPUs serves the
        lending bucket) or is about to train (`reclaim`: every lent engine is parked, handing its
        turns back). Only the trainer holding the role, under its current fencing token."""
        require(self.lease is not None, "this planner does not hold the planner lease")
        require(req.want in ("lend", "reclaim"), f"want must be lend or reclaim, not {req.want!r}")
        require(self.cfg.planner.lending.engines > 0, "lending is off (planner.lending.engines is 0)")
        trainer = next((s for s in self.slots.values() if s.role == "train"), None)
        require(
            trainer is not None and trainer.fencing_token == req.fencing_token,
            f"fencing token {req.fencing_token} is not the trainer's: only the trainer holding the role lends",
        )
        src, dst = (PARKED_ROLE, LENT_ROLE) if req.want == "lend" else (LENT_ROLE, PARKED_ROLE)
        moving = sorted((s for s in self.slots.values() if s.role == src), key=lambda s: s.worker_id)
        if moving:
            changes = await self._move_all(moving, dst, self.cfg.lending_bucket, req.want)
            require(changes is not None, "the planner lost its lease before publishing the change")
        return ev.LendReply(workers=[s.worker_id for s in moving], plan_version=self.version)

    async def _pool_moves(self) -> None:
        """The hybrid pool's own joins, cancels and releases (`planner.hybrid`)."""
        roles = {s.worker_id: (s.role, s.bucket) for s in self.slots.values() if s.role in MOVABLE_ROLES}
        for move in self.pool.decide(time.monotonic(), roles):
            slot = self.slots.get(move.worker_id)
            if (
                slot is not None
                and await self._move(slot, move.to_role, slot.bucket, f"hybrid_{move.why}") is None
            ):
                return

    async def _on_hybrid_state(self, msg: ev.HybridState, _: Envelope) -> None:
        """A worker's step through a role change, kept with the run's role changes (its cost).
        Only from the worker the plan has under that token; `ready` repeats and is not kept."""
        slot = self.slots.get(msg.worker_id)
        if msg.state == "ready" or slot is None or slot.fencing_token != msg.fencing_token:
            return
        self.pool.observe_state(time.monotonic(), msg)
        async with self._history:
            await self._record_role_change(
                {
                    "worker": msg.worker_id,
                    "state": msg.state,
                    "seconds": round(msg.seconds, 3),
                    "generation": msg.generation,
                    "detail": msg.detail[:200],
                    "turns_handed_back": msg.turns_handed_back,
                }
            )

    async def _record_role_change(self, entry: dict[str, object]) -> None:
        if self.lease is None:
            return
        entry["at"] = time.time()
        with contextlib.suppress(Exception):  # the history is for the report: a Redis blip loses one line
            await self.history.record_role_change(self.lease.token, entry)

    async def _on_workload(self, stats: ev.WorkloadStats, _: Envelope) -> None:
        self.replanner.observe_workload(time.monotonic(), stats)
        self.pool.observe_workload(stats)

    async def _on_train_metrics(self, m: ev.TrainMetrics, _: Envelope) -> None:
        self.replanner.observe_step(time.monotonic(), m)
        self.pool.observe_step(m)

    async def _on_hello(self, hello: ev.WorkerHello, _: Envelope) -> None:
        require(bool(hello.worker_id), "worker hello without worker_id")
        require(
            hello.kind in ("rollout-engine", "trainer", "tool-sandbox", "scheduler"),
            f"unknown kind {hello.kind!r}",
        )
        known = self.slots.get(hello.worker_id)
        if known is not None:
            if not hello.weight_sync_addr or hello.weight_sync_addr == known.weight_sync_addr:
                return
            # the same engine id at a new address: it restarted. Its lease moves to a new token, so
            # the plan changes and the scheduler re-sends what the old process had in flight.
            self.slots.pop(hello.worker_id)
            self.log.info("worker_restarted", worker_id=hello.worker_id, addr=hello.weight_sync_addr)
        slot: Slot | None
        if hello.trainer_engine:
            slot = self._trainer_engine(hello)
        else:
            slot = self.assigner.assign(
                hello.worker_id,
                hello.kind,
                hello.preferred_bucket,
                self.slots,
                addr=hello.weight_sync_addr,
                tp=hello.tensor_parallel or 1,
            )
        if slot is None:
            return
        if (
            self.cfg.planner.relayout
            and known is not None
            and slot.role == "rollout"
            and known.role in ("rollout", SPARE_ROLE)
            and (known.role == SPARE_ROLE or known.bucket in {b.name for b in self.buckets})
        ):
            # a restarted engine goes back where the current layout has it (its bucket, or spare
            # with the GPUs it kept), not where the config's engines per bucket would put it
            slot.role, slot.bucket, slot.tensor_parallel = known.role, known.bucket, known.tensor_parallel
        spec = next((b for b in self.buckets if b.name == slot.bucket), None)
        if (
            self.assigner.tps is not None
            and spec is not None
            and spec.tensor_parallel != slot.tensor_parallel
        ):
            self.log.warning(
                "engine_tp_mismatch",
                worker_id=slot.worker_id,
                engine_tp=slot.tensor_parallel,
                bucket=slot.bucket,
                bucket_tp=spec.tensor_parallel,
                hint="no bucket has this engine's TP: start it with LIBRA_ROLLOUT_ENGINE_TENSOR_PARALLEL "
                "set to a bucket's rollout.buckets[].tensor_parallel",
            )
        self._lendable(slot)
        lease = await self.store.acquire(
            lease_resource(slot.role, slot.worker_id),
            slot.worker_id,
            self.cfg.job.lease_ttl_s,
            meta=slot.role,
        )
        if lease is None:
            self.log.info("lease_busy", worker_id=slot.worker_id, role=slot.role)
            return  # e.g. the trainer role is still leased by a dead trainer; retried on its next hello
        slot.fencing_token = lease.token
        self.slots[slot.worker_id] = slot
        self.dirty = True
        self.log.info(
            "worker_registered",
            worker_id=slot.worker_id,
            role=slot.role,
            bucket=slot.bucket,
            token=lease.token,
        )

    def _trainer_engine(self, hello: ev.WorkerHello) -> Slot:
        """The trainer's own engine (planner.lending.trainer_serves): parked, at the lent TP in the
        lending bucket, until the trainer lends it."""
        lend = self.cfg.planner.lending
        require(lend.trainer_serves, "a trainer's engine, but planner.lending.trainer_serves is off")
        require(
            hello.kind == "trainer" and hello.worker_id.endswith(TRAINER_ENGINE_SUFFIX),
            f"a trainer's engine is kind 'trainer' named '<trainer>{TRAINER_ENGINE_SUFFIX}', "
            f"not {hello.kind} {hello.worker_id!r}",
        )
        return Slot(
            hello.worker_id, hello.kind, PARKED_ROLE, self.cfg.lending_bucket, "", lend.tensor_parallel
        )

    def _lendable(self, slot: Slot) -> None:
        """Engines past `rollout.engines` stand for the training GPUs (planner.lending.engines of
        them): parked, at the lent TP, until the trainer lends them (unless the trainer is the
        lent engine itself)."""
        lend = self.cfg.planner.lending
        if slot.role != "rollout" or lend.engines == 0 or lend.trainer_serves:
            return
        roles = Counter(s.role for s in self.slots.values() if s.worker_id != slot.worker_id)
        if (
            roles["rollout"] >= self.cfg.rollout.engines
            and roles[PARKED_ROLE] + roles[LENT_ROLE] < lend.engines
        ):
            slot.role, slot.bucket, slot.tensor_parallel = (
                PARKED_ROLE,
                self.cfg.lending_bucket,
                lend.tensor_parallel,
            )

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            try:
                await self._tick()
            except Exception as err:  # Redis or NATS away: the plan stands, the next tick tries again
                self.log.warning("planner_tick_failed", error=f"{type(err).__name__}: {err}")

    async def _tick(self) -> None:
        """Keeps the planner's own lease, drops workers whose lease ran out, promotes a standby
        trainer if the role is free, re-fits the buckets when a trigger fires, and publishes the
        plan if it changed."""
        if not await self._hold_lease():
            return
        for slot in list(self.slots.values()):
            held = await self.store.holder(lease_resource(slot.role, slot.worker_id))
            if held is None or held.token != slot.fencing_token:
                self.slots.pop(slot.worker_id)
                self.dirty = True
                self.log.warning("worker_lease_expired", worker_id=slot.worker_id, role=slot.role)
        if not any(s.role == "train" for s in self.slots.values()):
            await self._promote_standby()
        await self._maybe_replan()
        if self.dirty:
            await self._publish()
        await self._pool_moves()

    async def _hold_lease(self) -> bool:
        """Renews the planner's lease, or takes it when free (a new epoch). Without it the planner
        does nothing: another planner may be in charge."""
        ttl = self.cfg.job.lease_ttl_s
        if self.lease is not None and await self.store.renew(self.lease, ttl):
            return True
        if self.lease is not None:
            self.log.warning("planner_lease_lost", epoch=self.lease.token)
            self.lease = None
        lease = await self.store.acquire(PLANNER_ROLE, self.worker_id, ttl, meta="planner")
        if lease is None:
            return False
        self.lease = lease
        self.dirty = True  # the plan goes out again under the new epoch
        self.log.info("planner_lease_taken", epoch=lease.token)
        return True

    async def _maybe_replan(self) -> None:
        """New bucket thresholds when a trigger fires and the predicted gain is worth it; with
        `planner.relayout`, the engines moved between buckets (and the buckets' TP) too when that
        is worth more."""
        replicas = {b.name: 0 for b in self.buckets}
        for s in self.slots.values():
            if s.role == "rollout" and s.bucket in replicas:
                replicas[s.bucket] += 1
        pool = self._engine_pool()
        before = self.replanner.last_what_if
        # Simulating candidates takes up to planner.what_if.budget_s: off the event loop, so leases
        # and heartbeats keep going (nothing else touches the replanner meanwhile but its inputs).
        decision = await asyncio.to_thread(
            self.replanner.decide, time.monotonic(), self.buckets, replicas, pool
        )
        what_if = self.replanner.last_what_if
        if what_if is not None and what_if is not before:
            planner_metrics().decision_s.observe(what_if.decision_s)
            self.log.info("replan_simulated", **what_if.record())
        if decision is None:
            return
        for b, limit in zip(self.buckets, decision.limits, strict=True):
            b.max_output_tokens = 0 if math.isinf(limit) else int(limit)
        self.reason, self.gain = f"replan:{decision.trigger}", decision.gain
        self.decision = decision.what_if
        self.dirty = True
        self.log.info(
            "buckets_refit",
            trigger=decision.trigger,
            thresholds={b.name: b.max_output_tokens for b in self.buckets},
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
        tp = {b.name: b.tensor_parallel for b in self.buckets}
        serving = [s for s in self.slots.values() if s.role == "rollout" and s.bucket in tp]
        spares = [s for s in self.slots.values() if s.role == SPARE_ROLE]
        gpus = sum(tp[s.bucket] for s in serving) + sum(s.tensor_parallel for s in spares)
        return EnginePool(len(serving) + len(spares), gpus, fixed_tp=self.cfg.rollout.backend != "emulated")

    async def _relayout(self, decision: RefitDecision, pool: EnginePool) -> None:
        """Moves engines to the decision's layout under one plan (`assign_layout`: a bucket with
        more engines than it needs gives its last ones to one that needs more, or leaves them
        spare; spares are taken first; with fixed TPs an engine only goes to a bucket of its TP)."""
        assert decision.layout is not None
        old_tp = {b.name: b.tensor_parallel for b in self.buckets}
        slots = {s.worker_id: s for s in self.slots.values() if s.role == "rollout" and s.bucket in old_tp}
        spares = {s.worker_id: s for s in self.slots.values() if s.role == SPARE_ROLE}
        members: dict[str, list[tuple[str, int]]] = {name: [] for name in old_tp}
        for s in slots.values():
            members[s.bucket].append((s.worker_id, old_tp[s.bucket]))
        target = assign_layout(
            members,
            [(s.worker_id, s.tensor_parallel) for s in spares.values()],
            decision.layout,
            pool.gpus,
            pool.fixed_tp,
        )
        for spec in self.buckets:
            spec.tensor_parallel = next(b.tp for b in decision.layout if b.name == spec.name)
        moves: list[tuple[Slot, str, str]] = []
        for worker_id, (bucket, tp) in target.items():
            s = slots.get(worker_id) or spares[worker_id]
            if not bucket:  # the GPUs the layout does not use stay with the spares
                if s.role != SPARE_ROLE:
                    moves.append((s, SPARE_ROLE, ""))
            elif s.role == SPARE_ROLE or s.bucket != bucket or old_tp[s.bucket] != tp:
                moves.append((s, "rollout", bucket))  # another bucket, or the same at another TP
            s.tensor_parallel = tp
        if moves:
            layout = ",".join(f"{b.name}={b.replicas}xTP{b.tp}" for b in decision.layout)
            await self._apply_moves(moves, "relayout", f"replan:{decision.trigger}:relayout:{layout}")

    async def _promote_standby(self) -> None:
        """The trainer's lease expired (dead, paused, cut off): a standby trainer takes the role under
        a new token and resumes from the last committed checkpoint; the old one, if it comes back,
        is fenced out and becomes a standby itself."""
        for slot in sorted(self.slots.values(), key=lambda s: s.worker_id):
            if slot.role != "standby":
                continue
            lease = await self.store.acquire(
                TRAINER_ROLE, slot.worker_id, self.cfg.job.lease_ttl_s, meta="train"
            )
            if lease is None:
                return  # the role is still leased (the old trainer's lease has not run out)
            slot.role, slot.fencing_token = "train", lease.token
            self.dirty = True
            self.log.warning("standby_promoted", worker_id=slot.worker_id, fencing_token=lease.token)
            return

    async def _publish_plan(self, plan: ev.Plan, attempts: int = 5) -> None:
        """Publishes the plan to its stream and reads it back: the stream's last plan must be this
        one. An ack proves little on its own (it comes to an inbox; a forged one would say
        stored), so a plan not found is published again (the msg id keeps that from storing it
        twice)."""
        msg_id = f"plan-{plan.planner_epoch}-{plan.plan_version}"
        for attempt in range(1, attempts + 1):
            await self.bus.publish_durable(subjects.PLAN, plan, msg_id=msg_id)
            stored = await self.bus.last_message(subjects.PLAN, "PLAN", ev.Plan)
            if stored == plan:
                return
            self.log.warning(
                "plan_not_stored",
                plan_version=plan.plan_version,
                stored_version=stored.plan_version if stored is not None else None,
                attempt=attempt,
            )
        raise RuntimeError(f"plan {plan.plan_version} is not in the PLAN stream after {attempts} publishes")

    async def _publish(self) -> bool:
        """Records and publishes the plan; False (nothing published) without the planner lease."""
        assert self.lease is not None
        plan = ev.Plan(
            plan_version=self.version + 1,
            reason=self.reason,
            lease_ttl_s=self.cfg.job.lease_ttl_s,
            planner_epoch=self.lease.token,
            predicted_gain=self.gain,
            buckets=self.buckets,
            assignments=[
                ev.Assignment(
                    worker_id=s.worker_id,
                    role=s.role,
                    bucket=s.bucket,
                    fencing_token=s.fencing_token,
                    weight_sync_addr=s.weight_sync_addr,
                    tensor_parallel=s.tensor_parallel,
                )
                for s in sorted(self.slots.values(), key=lambda s: s.worker_id)
            ],
        )
        record = {
            "version": plan.plan_version,
            "epoch": plan.planner_epoch,
            "reason": plan.reason,
            "predicted_gain": round(plan.predicted_gain, 4),
            "buckets": {b.name: b.max_output_tokens or None for b in plan.buckets},
            "layout": {
                b.name: f"{sum(a.role == 'rollout' and a.bucket == b.name for a in plan.assignments)}xTP"
                f"{b.tensor_parallel}"
                for b in plan.buckets
            },
            "workers": len(plan.assignments),
            "at": time.time(),
        }
        if self.decision is not None:
            record["decision"] = self.decision
        if not await self.history.record_plan(self.lease.token, record):
            self.log.warning("plan_not_published_lease_lost", epoch=self.lease.token)
            self.lease = None
            return False
        self.version = plan.plan_version
        m = planner_metrics()
        m.plans.inc()
        m.plan_version.set(plan.plan_version)
        roles = Counter(a.role for a in plan.assignments)
        for role in {*ROLE_BY_KIND.values(), HYBRID_ROLE, LENT_ROLE, PARKED_ROLE, "standby"}:
            m.workers.labels(role).set(roles.get(role, 0))
        await self._publish_plan(plan)
        self.dirty = False
        self.reason, self.gain, self.decision = "membership", 0.0, None
        self.log.info(
            "plan_published", plan_version=self.version, epoch=plan.planner_epoch, workers=len(self.slots)
        )
        return True


async def serve(
    common: CommonSettings, run: RunConfig, stop: asyncio.Event, stack: contextlib.AsyncExitStack
) -> None:
    settings = load_settings(PlannerSettings)
    cfg = run
    assert common.worker_id is not None
    bus = await Bus.connect(
        common.nats_url, common.run_id, "planner", common.worker_id, common.nats_auth(), common.nats_tls()
    )
    stack.push_async_callback(bus.close)
    store = common.ownership_store()
    stack.push_async_callback(store.close)
    await PlannerService(settings, cfg, bus, store, common.worker_id).start()
    get_logger().info("planner_ready", buckets=[b.name for b in cfg.rollout.buckets])
    await stop.wait()
