"""Role moves under the plan: an operator's role request, the trainer's lend and reclaim, the
hybrid pool's own joins and releases, and a re-layout's moves — each applied under one plan,
recorded in the role history, then announced on `plan.role_change`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.errors import require
from services.common.logging import get_logger
from services.common.membership import LENT_ROLE, PARKED_ROLE
from services.common.runconfig import PlanJob
from services.common.tracing import tracer
from services.planner.elastic import LivePool
from services.planner.history import PlanHistory
from services.planner.plan_state import PlanState
from services.planner.publishing import PlanPublisher
from services.policy.assign import Slot

MOVABLE_ROLES = ("rollout", "draining", "hybrid")
"""Roles an operator (or the planner itself) may move an engine between: serving a bucket, out of
rollout, or in the trainer's data-parallel group (the hybrid pool)."""


class RoleMoves:
    def __init__(
        self,
        job: PlanJob,
        bus: Bus,
        state: PlanState,
        publisher: PlanPublisher,
        history: PlanHistory,
        pool: LivePool,
    ):
        self.job, self.bus, self.state, self.publisher = job, bus, state, publisher
        self.history, self.pool = history, pool
        self.ordered = asyncio.Lock()
        """Orders the role history: a change is recorded before the steps its plan sets off."""
        self.log = get_logger(component="planner")

    async def on_role_request(self, req: ev.RoleChange) -> ev.RoleChange:
        """Moves an engine between rollout buckets, or out of rollout (`draining`: it hands its
        turns back and takes no new ones) and back. Answers with the change as applied, under the
        worker's fencing token; the plan goes out at once and the change on `plan.role_change`."""
        s = self.state
        require(s.lease is not None, "this planner does not hold the planner lease")
        slot = s.slots.get(req.worker_id)
        require(slot is not None, f"unknown worker {req.worker_id!r}")
        assert slot is not None
        require(
            slot.role in MOVABLE_ROLES and req.to_role in MOVABLE_ROLES,
            f"only engines move between {'/'.join(MOVABLE_ROLES)} ({req.worker_id} is {slot.role!r})",
        )
        names = [b.name for b in s.buckets]
        bucket = req.bucket or slot.bucket
        require(req.to_role != "rollout" or bucket in names, f"unknown bucket {bucket!r}; known: {names}")
        change = await self.move(slot, req.to_role, bucket, "role_change")
        require(change is not None, "the planner lost its lease before publishing the change")
        assert change is not None
        return change

    async def on_lend_request(self, req: ev.LendRequest) -> ev.LendReply:
        """The trainer waits for its batch (`lend`: every parked engine on its GPUs serves the
        lending bucket) or is about to train (`reclaim`: every lent engine is parked, handing its
        turns back). Only the trainer holding the role, under its current fencing token."""
        s = self.state
        require(s.lease is not None, "this planner does not hold the planner lease")
        require(req.want in ("lend", "reclaim"), f"want must be lend or reclaim, not {req.want!r}")
        require(self.job.planner.lending.engines > 0, "lending is off (planner.lending.engines is 0)")
        trainer = next((slot for slot in s.slots.values() if slot.role == "train"), None)
        require(
            trainer is not None and trainer.fencing_token == req.fencing_token,
            f"fencing token {req.fencing_token} is not the trainer's: only the trainer holding the role lends",
        )
        src, dst = (PARKED_ROLE, LENT_ROLE) if req.want == "lend" else (LENT_ROLE, PARKED_ROLE)
        moving = sorted(
            (slot for slot in s.slots.values() if slot.role == src), key=lambda slot: slot.worker_id
        )
        if moving:
            changes = await self.apply([(slot, dst, self.job.lending_bucket) for slot in moving], req.want)
            require(changes is not None, "the planner lost its lease before publishing the change")
        return ev.LendReply(workers=[slot.worker_id for slot in moving], plan_version=s.version)

    async def pool_moves(self) -> None:
        """The hybrid pool's own joins, cancels and releases (`planner.hybrid`)."""
        s = self.state
        roles = {
            slot.worker_id: (slot.role, slot.bucket)
            for slot in s.slots.values()
            if slot.role in MOVABLE_ROLES
        }
        for move in self.pool.decide(time.monotonic(), roles):
            slot = s.slots.get(move.worker_id)
            if (
                slot is not None
                and await self.move(slot, move.to_role, slot.bucket, f"hybrid_{move.why}") is None
            ):
                return

    async def on_hybrid_state(self, msg: ev.HybridState) -> None:
        """A worker's step through a role change, kept with the run's role changes (its cost).
        Only from the worker the plan has under that token; `ready` repeats and is not kept."""
        slot = self.state.slots.get(msg.worker_id)
        if msg.state == "ready" or slot is None or slot.fencing_token != msg.fencing_token:
            return
        self.pool.observe_state(time.monotonic(), msg)
        async with self.ordered:
            await self._record(
                {
                    "worker": msg.worker_id,
                    "state": msg.state,
                    "seconds": round(msg.seconds, 3),
                    "generation": msg.generation,
                    "detail": msg.detail[:200],
                    "turns_handed_back": msg.turns_handed_back,
                }
            )

    async def move(self, slot: Slot, to_role: str, bucket: str, why: str) -> ev.RoleChange | None:
        """Applies a role change to the plan and publishes both (None: the lease was lost first)."""
        changes = await self.apply([(slot, to_role, bucket)], why)
        return changes[0] if changes else None

    async def apply(
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
        names = ",".join(slot.worker_id for slot, _, _ in moves)
        s = self.state
        s.reason = reason or (
            f"{why}:{names}:{changes[0].from_role}->{changes[0].to_role}" if changes else why
        )
        s.dirty = True
        async with self.ordered:  # the workers' first steps, which may come at once, go after it
            if not await self.publisher.publish():
                return None
            for change, (slot, _, _) in zip(changes, moves, strict=True):
                await self._record(
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

    async def _record(self, entry: dict[str, object]) -> None:
        lease = self.state.lease
        if lease is None:
            return
        entry["at"] = time.time()
        with contextlib.suppress(Exception):  # the history is for the report: a Redis blip loses one line
            await self.history.record_role_change(lease.token, entry)
