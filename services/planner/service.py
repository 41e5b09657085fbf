"""The planner's service shell: registers workers with leased, fenced ownership in Redis and
publishes the plan (durably, on JetStream) whenever it changes."""

from __future__ import annotations

import asyncio
import contextlib

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.config import CommonSettings, load_settings
from services.common.contracts import ev
from services.common.errors import require
from services.common.logging import get_logger
from services.common.membership import TRAINER_ROLE, lease_resource
from services.common.ownership import OwnershipStore
from services.common.runconfig import RunConfig, load_run_config
from services.planner.assign import Slot, StaticAssigner
from services.planner.config import PlannerSettings


class PlannerService:
    def __init__(self, settings: PlannerSettings, cfg: RunConfig, bus: Bus, store: OwnershipStore):
        self.settings, self.cfg, self.bus, self.store = settings, cfg, bus, store
        self.assigner = StaticAssigner([b.name for b in cfg.rollout.buckets])
        self.slots: dict[str, Slot] = {}
        self.version = 0
        self.dirty = False
        self.log = get_logger(component="planner")

    async def start(self) -> None:
        self.stream = await self.bus.ensure_stream("PLAN", [subjects.PLAN], max_msgs_per_subject=1)
        last = await self.bus.last_message(subjects.PLAN, self.stream, ev.Plan)
        if last is not None:  # a restarted planner continues the plan, and its version numbers
            self.version = last.plan_version
            for a in last.assignments:
                self.slots[a.worker_id] = Slot(
                    a.worker_id, "", a.role, a.bucket, a.weight_sync_addr, a.tensor_parallel, a.fencing_token
                )
        await self.bus.subscribe(subjects.WORKER_HELLO, ev.WorkerHello, self._on_hello)
        self.bus.spawn(self._loop())

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

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_s)
            try:
                await self._tick()
            except Exception as err:  # Redis or NATS away: the plan stands, the next tick tries again
                self.log.warning("planner_tick_failed", error=f"{type(err).__name__}: {err}")

    async def _tick(self) -> None:
        """Drops workers whose lease ran out, promotes a standby trainer if the role is free, and
        publishes the plan if it changed."""
        for slot in list(self.slots.values()):
            held = await self.store.holder(lease_resource(slot.role, slot.worker_id))
            if held is None or held.token != slot.fencing_token:
                self.slots.pop(slot.worker_id)
                self.dirty = True
                self.log.warning("worker_lease_expired", worker_id=slot.worker_id, role=slot.role)
        if not any(s.role == "train" for s in self.slots.values()):
            await self._promote_standby()
        if self.dirty:
            await self._publish()

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

    async def _publish(self) -> None:
        self.version += 1
        plan = ev.Plan(
            plan_version=self.version,
            reason="static",
            lease_ttl_s=self.cfg.job.lease_ttl_s,
            buckets=[
                ev.BucketSpec(
                    name=b.name,
                    tensor_parallel=b.tensor_parallel,
                    max_context_tokens=b.max_context_tokens,
                    max_output_tokens=b.max_output_tokens or 0,
                )
                for b in self.cfg.rollout.buckets
            ],
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
        await self.bus.publish_durable(subjects.PLAN, plan, msg_id=f"plan-{self.version}")
        self.dirty = False
        self.log.info("plan_published", plan_version=self.version, workers=len(self.slots))


async def serve(common: CommonSettings, stop: asyncio.Event, stack: contextlib.AsyncExitStack) -> None:
    settings = load_settings(PlannerSettings)
    cfg = load_run_config(common.config)
    assert common.worker_id is not None
    bus = await Bus.connect(
        common.nats_url, common.run_id, "planner", common.worker_id, common.nats_auth(), common.nats_tls()
    )
    stack.push_async_callback(bus.close)
    store = OwnershipStore.from_url(common.redis_url, common.run_id, common.redis_secret(), common.tls())
    stack.push_async_callback(store.close)
    await PlannerService(settings, cfg, bus, store).start()
    get_logger().info("planner_ready", buckets=[b.name for b in cfg.rollout.buckets])
    await stop.wait()
