"""Workers joining the plan and leaving it: a hello gets a role (`StaticAssigner`) and a leased,
fenced slot in Redis; a worker whose lease ran out leaves the plan; a standby trainer or scheduler
takes its kind's role when it is free."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

from services.common.contracts import ev
from services.common.credentials import TRAINER_ENGINE_SUFFIX
from services.common.errors import require
from services.common.logging import get_logger
from services.common.membership import LENT_ROLE, PARKED_ROLE, SPARE_ROLE, lease_resource
from services.common.ownership import Lease, OwnershipStore
from services.common.runconfig import PlanJob
from services.planner.plan_state import PlanState
from services.policy.assign import ROLE_BY_KIND, SINGLE_ROLES, Slot, StaticAssigner

KINDS = ("rollout-engine", "trainer", "tool-sandbox", "scheduler")


class Registration:
    def __init__(self, job: PlanJob, store: OwnershipStore, state: PlanState):
        self.job, self.store, self.state = job, store, state
        self.assigner = StaticAssigner(
            [b.name for b in job.rollout.buckets],
            job.bucket_engines,
            # vLLM's TP is fixed when it starts: it serves a bucket of that TP
            {b.name: b.tensor_parallel for b in job.rollout.buckets}
            if job.rollout.backend == "vllm"
            else None,
        )
        self.log = get_logger(component="planner")
        self._gone_since: dict[str, float] = {}
        """Role holders whose probe found no subscriber, since when (`replace_gone`)."""

    async def on_hello(self, hello: ev.WorkerHello) -> None:
        require(bool(hello.worker_id), "worker hello without worker_id")
        require(hello.kind in KINDS, f"unknown kind {hello.kind!r}")
        s = self.state
        known = s.slots.get(hello.worker_id)
        if known is not None:
            if not hello.weight_sync_addr or hello.weight_sync_addr == known.weight_sync_addr:
                return
            # the same engine id at a new address: it restarted. Its lease moves to a new token, so
            # the plan changes and the scheduler re-sends what the old process had in flight.
            s.slots.pop(hello.worker_id)
            self.log.info("worker_restarted", worker_id=hello.worker_id, addr=hello.weight_sync_addr)
        slot: Slot | None
        if hello.trainer_engine:
            slot = self._trainer_engine(hello)
        else:
            slot = self.assigner.assign(
                hello.worker_id,
                hello.kind,
                hello.preferred_bucket,
                s.slots,
                addr=hello.weight_sync_addr,
                tp=hello.tensor_parallel or 1,
            )
        if slot is None:
            return
        if (
            self.job.planner.relayout
            and known is not None
            and slot.role == "rollout"
            and known.role in ("rollout", SPARE_ROLE)
            and (known.role == SPARE_ROLE or known.bucket in {b.name for b in s.buckets})
        ):
            # a restarted engine goes back where the current layout has it (its bucket, or spare
            # with the GPUs it kept), not where the config's engines per bucket would put it
            slot.role, slot.bucket, slot.tensor_parallel = known.role, known.bucket, known.tensor_parallel
        self._warn_tp_mismatch(slot)
        self._lendable(slot)
        lease = await self.store.acquire(
            lease_resource(slot.role, slot.worker_id),
            slot.worker_id,
            self.job.lease_ttl_s,
            meta=slot.role,
        )
        if lease is None:
            self.log.info("lease_busy", worker_id=slot.worker_id, role=slot.role)
            return  # e.g. the trainer role is still leased by a dead trainer; retried on its next hello
        slot.fencing_token = lease.token
        s.slots[slot.worker_id] = slot
        s.dirty = True
        self.log.info(
            "worker_registered",
            worker_id=slot.worker_id,
            role=slot.role,
            bucket=slot.bucket,
            token=lease.token,
        )

    def _warn_tp_mismatch(self, slot: Slot) -> None:
        spec = next((b for b in self.state.buckets if b.name == slot.bucket), None)
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

    def _trainer_engine(self, hello: ev.WorkerHello) -> Slot:
        """The trainer's own engine (planner.lending.trainer_serves): parked, at the lent TP in the
        lending bucket, until the trainer lends it."""
        lend = self.job.planner.lending
        require(lend.trainer_serves, "a trainer's engine, but planner.lending.trainer_serves is off")
        require(
            hello.kind == "trainer" and hello.worker_id.endswith(TRAINER_ENGINE_SUFFIX),
            f"a trainer's engine is kind 'trainer' named '<trainer>{TRAINER_ENGINE_SUFFIX}', "
            f"not {hello.kind} {hello.worker_id!r}",
        )
        return Slot(
            hello.worker_id, hello.kind, PARKED_ROLE, self.job.lending_bucket, "", lend.tensor_parallel
        )

    def _lendable(self, slot: Slot) -> None:
        """Engines past `rollout.engines` stand for the training GPUs (planner.lending.engines of
        them): parked, at the lent TP, until the trainer lends them (unless the trainer is the
        lent engine itself)."""
        lend = self.job.planner.lending
        if slot.role != "rollout" or lend.engines == 0 or lend.trainer_serves:
            return
        roles = Counter(s.role for s in self.state.slots.values() if s.worker_id != slot.worker_id)
        if (
            roles["rollout"] >= self.job.rollout.engines
            and roles[PARKED_ROLE] + roles[LENT_ROLE] < lend.engines
        ):
            slot.role, slot.bucket, slot.tensor_parallel = (
                PARKED_ROLE,
                self.job.lending_bucket,
                lend.tensor_parallel,
            )

    async def expire(self) -> None:
        """Drops the workers whose lease ran out (or moved to another token)."""
        s = self.state
        slots = list(s.slots.values())
        leases = await self.store.holders([lease_resource(slot.role, slot.worker_id) for slot in slots])
        for slot, held in zip(slots, leases, strict=True):
            if s.slots.get(slot.worker_id) is not slot:
                continue  # replaced while the leases were read (a hello of a restarted worker)
            if held is None or held.token != slot.fencing_token:
                s.slots.pop(slot.worker_id)
                s.dirty = True
                self.log.warning("worker_lease_expired", worker_id=slot.worker_id, role=slot.role)

    async def replace_gone(self, there: Callable[[Slot], Awaitable[bool]], gone_s: float, now: float) -> None:
        """A trainer or scheduler holding its role whose process is gone (`there` is False: NATS
        has no subscriber of its probe subject, which goes with the connection of a process that
        died) for `gone_s` while a standby of its kind is warm: its lease is released, and
        `promote_standby` gives the standby the role in the same tick rather than when the lease
        runs out (a lease is long at a thousand engines). A holder that is there but busy or
        paused keeps the role until its lease runs out; without a standby, a restarted process
        takes its role back under its lease, as before."""
        s = self.state
        standby = {o.kind for o in s.slots.values() if o.role == "standby"}
        held = [o for o in s.slots.values() if o.role in SINGLE_ROLES and o.kind in standby]
        for worker in set(self._gone_since) - {o.worker_id for o in held}:
            del self._gone_since[worker]
        found = await asyncio.gather(*(there(slot) for slot in held))
        for slot, is_there in zip(held, found, strict=True):
            if is_there:
                self._gone_since.pop(slot.worker_id, None)
                continue
            since = self._gone_since.setdefault(slot.worker_id, now)
            if now - since < gone_s:
                continue
            del self._gone_since[slot.worker_id]
            lease = Lease(lease_resource(slot.role, slot.worker_id), slot.worker_id, slot.fencing_token)
            released = await self.store.release(lease)
            s.slots.pop(slot.worker_id, None)
            s.dirty = True
            self.log.warning(
                "role_holder_gone",
                worker_id=slot.worker_id,
                role=slot.role,
                fencing_token=slot.fencing_token,
                gone_s=round(now - since, 2),
                lease_released=released,
            )

    async def promote_standby(self) -> None:
        """A trainer's or a scheduler's lease expired (dead, paused, cut off): a standby of its kind
        takes the role under a new token and resumes from what the job recorded (the committed
        checkpoint, the scheduler's ledger); the old one, if it comes back, is fenced out."""
        for role in SINGLE_ROLES:
            await self._promote(role)

    async def _promote(self, role: str) -> None:
        s = self.state
        if any(slot.role == role for slot in s.slots.values()):
            return
        kind = next(k for k, r in ROLE_BY_KIND.items() if r == role)
        for slot in sorted(s.slots.values(), key=lambda slot: slot.worker_id):
            if slot.role != "standby" or slot.kind != kind:
                continue
            lease = await self.store.acquire(
                lease_resource(role, slot.worker_id), slot.worker_id, self.job.lease_ttl_s, meta=role
            )
            if lease is None:
                return  # the role is still leased (the old holder's lease has not run out)
            slot.role, slot.fencing_token = role, lease.token
            s.dirty = True
            self.log.warning(
                "standby_promoted", worker_id=slot.worker_id, kind=kind, fencing_token=lease.token
            )
            return
