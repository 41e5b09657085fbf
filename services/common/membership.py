"""A worker's side of the planner protocol: say hello, learn its assignment, keep its lease alive.

The planner assigns each worker a role (and bucket) and takes a lease for it in Redis, whose fencing
token it publishes in the plan. The worker renews that lease while it lives; if it stops (crash,
pause, partition) the lease expires and the planner re-plans. Plans are on a JetStream stream, so a
worker that starts late still reads the current one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeGuard

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import ev
from services.common.credentials import ALIVE_KINDS
from services.common.logging import get_logger
from services.common.ownership import Lease, OwnershipStore
from services.common.tasks import retried

DEFAULT_LEASE_TTL_S = 10.0
"""Until the first plan says otherwise (the run config's job.lease_ttl_s)."""
TRAINER_ROLE = "role:trainer"
PLANNER_ROLE = "role:planner"
"""The planner's lease: the planner that holds it plans and records the plan history."""
SCHEDULER_ROLE = "role:scheduler"
"""The scheduler's lease: the scheduler that holds it runs the job's trajectories and writes its
ledger; further schedulers stand by (services/scheduler/leadership.py)."""
ROLE_LEASES = {"train": TRAINER_ROLE, "schedule": SCHEDULER_ROLE}
"""The roles one worker holds at a time: leased as the role itself, so a standby takes it only once
the holder's lease has run out."""
HYBRID_ROLE = "hybrid"
"""An engine in the trainer's data-parallel group (services/learning/hybrid.py)."""
LENT_ROLE = "lent"
"""An engine on the trainer's GPUs serving rollout while the trainer waits for its batch."""
PARKED_ROLE = "parked"
"""An engine on the trainer's GPUs while the trainer trains: it serves nothing."""
SPARE_ROLE = "spare"
"""An engine the planner's re-layout left without a bucket (its GPUs went to engines of a bigger
TP): it serves nothing until a re-layout needs it again (docs/planner.md)."""
SERVING_ROLES = ("rollout", LENT_ROLE)
"""Roles in which an engine serves turns (and takes every new weight version). Not `draining`
(out of rollout), `spare` (left over by a re-layout), `parked` (its GPUs are training) nor `hybrid` (in the trainer's data-parallel
group, services/learning/hybrid.py)."""


def lease_resource(role: str, worker_id: str) -> str:
    """The trainer's and the scheduler's lease is the role itself (one owner at a time, `ROLE_LEASES`);
    other workers lease themselves."""
    return ROLE_LEASES.get(role, f"worker:{worker_id}")


def leased_again(held: Lease | None, owner: str, token: int) -> TypeGuard[Lease]:
    """Whether `held` is a lapsed lease of `owner` under `token` that the planner leased to it again,
    nobody holding it in between: the same owner, the next fencing token."""
    return held is not None and held.owner == owner and held.token == token + 1


class Membership:
    def __init__(
        self,
        bus: Bus,
        store: OwnershipStore,
        hello: ev.WorkerHello,
        on_plan: Callable[[ev.Plan], Awaitable[None]] | None = None,
    ):
        self.bus = bus
        self.store = store
        self.hello = hello
        self.on_plan = on_plan
        self.plan: ev.Plan | None = None
        self.assignment: ev.Assignment | None = None
        self.assigned = asyncio.Event()
        self.log = get_logger(component="membership")
        self.lease_lost = 0
        self._valid_until = 0.0
        self._renew_now = asyncio.Event()
        self._plan_applied = asyncio.Event()
        self._retaken = 0
        """A token of this worker's lease learnt from Redis before any plan named it (`retaken`)."""
        self._adopted: tuple[str, int] | None = None
        """A role and token leased to this worker that Redis showed before any plan named them (`adopt`)."""

    @property
    def lease_ttl_s(self) -> float:
        return (
            self.plan.lease_ttl_s
            if self.plan is not None and self.plan.lease_ttl_s > 0
            else DEFAULT_LEASE_TTL_S
        )

    def holds_lease(self) -> bool:
        """Assigned, and the lease was renewed less than a TTL ago: only then may the worker act.
        A worker paused or cut off from Redis for longer may have been replaced already."""
        return self.assignment is not None and time.monotonic() < self._valid_until

    async def start(self) -> None:
        h = self.hello
        if h.kind in ALIVE_KINDS and not h.trainer_engine:
            # there while this process is (never answered): when it dies its subscription goes
            # with its connection, and the planner's probe finds nobody (a standby takes the role)
            await self.bus.nc.subscribe(
                self.bus.subject(subjects.spoken(subjects.ALIVE, h.kind, h.worker_id))
            )
        await self.bus.bind_stream("PLAN")
        await self.bus.subscribe(subjects.PLAN, ev.Plan, self._on_plan_msg)
        last = await self.bus.last_message(subjects.PLAN, "PLAN", ev.Plan)
        if last is not None:
            await self._apply(last)
        self.bus.on_reconnect(self._catch_up)
        self.bus.spawn(self._hello_loop())
        self.bus.spawn(self._renew_loop())

    async def wait_assigned(self, timeout: float) -> ev.Assignment:
        await asyncio.wait_for(self.assigned.wait(), timeout)
        assert self.assignment is not None
        return self.assignment

    async def plan_at_least(self, version: int, timeout: float) -> bool:
        """Waits until this worker follows plan `version` or a later one (False: not within
        `timeout` seconds)."""
        try:
            async with asyncio.timeout(timeout):
                while self.plan is None or self.plan.plan_version < version:
                    self._plan_applied.clear()
                    await self._plan_applied.wait()
        except TimeoutError:
            return False
        return True

    async def release(self) -> None:
        """Gives this worker's lease up as it stops, so the planner re-plans at once rather than
        when the lease runs out (best effort: Redis away, it runs out)."""
        a = self.assignment
        if a is None:
            return
        with contextlib.suppress(Exception):
            await self.store.release(Lease(lease_resource(a.role, a.worker_id), a.worker_id, a.fencing_token))

    def peers(self, *roles: str) -> list[ev.Assignment]:
        if self.plan is None:
            return []
        return [a for a in self.plan.assignments if a.role in roles]

    async def _on_plan_msg(self, plan: ev.Plan, _: Envelope) -> None:
        await self._apply(plan)

    async def _catch_up(self) -> None:
        """After NATS was away: the plans published meanwhile never came (a core subscription),
        and the planner publishes again only when the plan changes, so a worker would follow the
        old one for good (an engine re-registered in the gap left out of the trainer's pushes and
        the scheduler's routing). The stream keeps the last plan: it is read and followed."""
        # (a restarted server's JetStream may take a moment to answer)
        last = await retried(
            lambda: self.bus.last_message(subjects.PLAN, "PLAN", ev.Plan), self.log, "plan_catch_up_failed"
        )
        mine = self.plan
        if last is None or (
            mine is not None
            and (last.planner_epoch, last.plan_version) == (mine.planner_epoch, mine.plan_version)
        ):
            return
        self.log.info(
            "plan_caught_up", plan_version=last.plan_version, before=mine.plan_version if mine else 0
        )
        await self._apply(last)

    async def _apply(self, plan: ev.Plan) -> None:
        if self.plan is not None:
            if plan.planner_epoch < self.plan.planner_epoch:
                # from a planner that lost its lease to the one whose plans we follow: refused
                self.log.warning(
                    "plan_refused_stale_planner",
                    epoch=plan.planner_epoch,
                    current_epoch=self.plan.planner_epoch,
                    plan_version=plan.plan_version,
                )
                return
            if plan.planner_epoch == self.plan.planner_epoch and plan.plan_version < self.plan.plan_version:
                return
        self.plan = plan
        mine = next((a for a in plan.assignments if a.worker_id == self.hello.worker_id), None)
        if mine is not None and self._retaken:
            if mine.role == self.assignment.role and mine.fencing_token < self._retaken:  # type: ignore[union-attr]
                mine = None  # a plan from before the retake: the token it names is gone
            else:
                self._retaken = 0  # the planner's plan names the retaken token (or moved the role)
        if mine is not None and self._adopted is not None:
            role, token = self._adopted
            if mine.role == role and mine.fencing_token >= token:
                self._adopted = None  # the plan names the role Redis showed (or a later token of it)
            else:
                mine = None  # a plan from before the planner leased this worker the role
        if mine is not None:
            changed = self.assignment is None or (mine.role, mine.bucket, mine.fencing_token) != (
                self.assignment.role,
                self.assignment.bucket,
                self.assignment.fencing_token,
            )
            self.assignment = mine
            if changed:
                # the planner has just taken this lease: good for a moment, confirmed by a renewal now
                self._valid_until = time.monotonic() + self.lease_ttl_s / 4
                self._renew_now.set()
                self.log.info(
                    "assignment", role=mine.role, bucket=mine.bucket, fencing_token=mine.fencing_token
                )
            self.assigned.set()
        self._plan_applied.set()
        if self.on_plan is not None:
            await self.on_plan(plan)

    def retaken(self, token: int) -> None:
        """This worker's lease lapsed and Redis shows the planner leased it to this worker
        again under `token`, before the plan saying so has come (a plan of a thousand engines
        reaches a busy worker seconds late): the lease is renewed under `token` meanwhile, or it
        would lapse again before the plan arrives. Plans that still name an older token are not
        followed for this assignment until one names `token`."""
        a = self.assignment
        if a is None or token <= a.fencing_token:
            return
        self.assignment = ev.Assignment()
        self.assignment.CopyFrom(a)
        self.assignment.fencing_token = token
        self._retaken = token
        self._valid_until = time.monotonic() + self.lease_ttl_s / 4  # Redis holds it: renewed now
        self._renew_now.set()

    def adopt(self, role: str, token: int) -> None:
        """Redis shows that the planner leased `role` to this worker under `token` (a standby
        promoted) before a plan saying so has come: a plan reaches a standby seconds late at a
        thousand engines, and the role is idle meanwhile. The assignment takes the role and token
        now, renewed at once; plans that name this worker otherwise are not followed for its
        assignment until one names the role under `token` or a later one."""
        a = self.assignment
        if a is None or (a.role, a.fencing_token) == (role, token):
            return
        self.assignment = ev.Assignment()
        self.assignment.CopyFrom(a)
        self.assignment.role, self.assignment.fencing_token = role, token
        self._adopted = (role, token)
        self._valid_until = time.monotonic() + self.lease_ttl_s / 4  # Redis holds it: renewed now
        self._renew_now.set()
        self.log.info("assignment", role=role, fencing_token=token, before_plan=True)

    async def _retake(self, lease: Lease) -> bool:
        """After a renewal refused: whether the lease lapsed and the planner leased it to this same
        worker again under the next token, nobody holding it in between (then `retaken`). Renewals
        late past a lease happen on a busy machine (2.5-9 s at 1,024 engines); a trainer or
        engine that waited for the plan naming the new token would lose the lease again meanwhile."""
        try:
            held = await self.store.holder(lease.resource)
        except Exception:  # Redis away: the lease counts as lost until it answers
            return False
        if not leased_again(held, lease.owner, lease.token):
            return False
        self.log.warning("lease_retaken", old_token=lease.token, fencing_token=held.token)
        self.retaken(held.token)
        return True

    async def _hello_loop(self) -> None:
        """Announces the worker until it is in a plan, then every few seconds as a liveness beacon."""
        while True:
            with contextlib.suppress(Exception):
                await self.bus.publish(subjects.WORKER_HELLO, self.hello)
            await asyncio.sleep(0.5 if not self.assigned.is_set() else self.lease_ttl_s / 3)

    async def _renew_loop(self) -> None:
        first = True
        while True:
            if not first:  # a restarted worker renews the lease it finds in the plan at once
                with contextlib.suppress(TimeoutError):  # a new assignment is renewed at once
                    await asyncio.wait_for(self._renew_now.wait(), self.lease_ttl_s / 4)
            first = False
            self._renew_now.clear()
            a = self.assignment
            if a is None:
                await asyncio.sleep(0.2)
                first = True
                continue
            lease = Lease(lease_resource(a.role, a.worker_id), a.worker_id, a.fencing_token)
            try:
                renewed_at = time.monotonic()
                ok = await self.store.renew(lease, self.lease_ttl_s)
            except Exception as err:  # Redis down: keep trying, the lease may still be live
                self.log.warning("lease_renew_failed", error=str(err))
                continue
            took = time.monotonic() - renewed_at
            if took > self.lease_ttl_s / 4:  # Redis answered, late: say so before a lease is at risk
                self.log.warning("redis_slow", renewal_s=round(took, 2), lease_ttl_s=self.lease_ttl_s)
            if ok:
                self._valid_until = renewed_at + self.lease_ttl_s
            elif self.assignment is not None and self.assignment.fencing_token == a.fencing_token:
                # (not for an assignment replaced while the renewal was under way)
                if await self._retake(lease):
                    continue
                self._valid_until = 0.0
                self.lease_lost += 1
                self.log.warning("lease_lost", fencing_token=a.fencing_token)
