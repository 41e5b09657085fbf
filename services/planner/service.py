"""The planner's service shell: registers workers with leased, fenced ownership in Redis,
re-fits the buckets to the live workload, and publishes the plan (durably, on JetStream) whenever
it changes.

The planner holds a lease of its own (`role:planner`); its fencing token is the plan's
`planner_epoch`. It records every plan in the run's plan history (Redis) under that lease before
publishing it, so a planner that lost its lease publishes nothing, and workers refuse a plan from
an older epoch than one they already follow.

The shell routes events to its parts, each with one job, around one `PlanState`: registration
and leases (`registration.py`), role moves (`roles.py`: role and lend requests, the hybrid
pool), re-fits (`refitting.py`) and publishing (`publishing.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.errors import NoRespondersError

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.config import CommonSettings, load_settings
from services.common.contracts import ev
from services.common.logging import get_logger
from services.common.ownership import Lease, OwnershipStore
from services.common.runconfig import PlanJob, RunConfig
from services.planner.config import PlannerSettings
from services.planner.elastic import LivePool
from services.planner.history import PlanHistory
from services.planner.plan_state import PlanState
from services.planner.publishing import PlanPublisher
from services.planner.refitting import Refitting
from services.planner.registration import Registration
from services.planner.roles import RoleMoves
from services.policy.assign import Slot

PROBE_S = 0.2
"""How long a probe of a role holder waits (`_there`): NATS answers at once when nobody subscribes."""


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
        job = PlanJob.of(cfg)
        self.state = PlanState.of_buckets(cfg.rollout.buckets)
        self.history = PlanHistory(bus, store)
        self.pool = LivePool(job)
        self.publisher = PlanPublisher(job.lease_ttl_s, bus, store, self.history, self.state, worker_id)
        self.registration = Registration(job, store, self.state)
        self.moves = RoleMoves(job, bus, self.state, self.publisher, self.history, self.pool)
        self.refitting = Refitting(cfg, self.state, self.moves)  # simulates the whole job
        self.log = get_logger(component="planner")

    @property
    def lease(self) -> Lease | None:
        return self.state.lease

    @property
    def dirty(self) -> bool:
        return self.state.dirty

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self.state.dirty = value

    async def start(self) -> None:
        await self.bus.bind_stream("PLAN")
        await self.history.start()
        last = await self.bus.last_message(subjects.PLAN, "PLAN", ev.Plan)
        if last is not None:
            self.state.continue_from(last)
        await self.bus.subscribe(subjects.WORKER_HELLO, ev.WorkerHello, self._on_hello)
        await self.bus.subscribe(subjects.WORKLOAD_STATS, ev.WorkloadStats, self._on_workload)
        await self.bus.subscribe(subjects.TRAIN_METRICS, ev.TrainMetrics, self._on_train_metrics)
        await self.bus.subscribe(subjects.ROLE_REQUEST, ev.RoleChange, self._on_role_request)
        await self.bus.subscribe(subjects.LEND_REQUEST, ev.LendRequest, self._on_lend_request)
        await self.bus.subscribe(subjects.HYBRID_STATE, ev.HybridState, self._on_hybrid_state)
        self.bus.spawn(self._loop())

    async def _there(self, slot: Slot) -> bool:
        """Whether a role holder's process is there: False only when NATS has no subscriber of its
        probe subject (the process and its connection are gone: NATS says so at once). A holder
        subscribes and never answers, so a probe of one that is there runs out its short wait;
        so does one while the planner's own connection is away (then its lease decides)."""
        subject = self.bus.subject(subjects.spoken(subjects.ALIVE, slot.kind, slot.worker_id))
        try:
            await self.bus.nc.request(subject, b"", timeout=PROBE_S)
        except NoRespondersError:
            return False
        except Exception:
            return True
        return True

    async def _on_hello(self, hello: ev.WorkerHello, _: Envelope) -> None:
        await self.registration.on_hello(hello)

    async def _on_role_request(self, req: ev.RoleChange, _: Envelope) -> ev.RoleChange:
        return await self.moves.on_role_request(req)

    async def _on_lend_request(self, req: ev.LendRequest, _: Envelope) -> ev.LendReply:
        return await self.moves.on_lend_request(req)

    async def _on_hybrid_state(self, msg: ev.HybridState, _: Envelope) -> None:
        await self.moves.on_hybrid_state(msg)

    async def _on_workload(self, stats: ev.WorkloadStats, _: Envelope) -> None:
        self.refitting.replanner.observe_workload(time.monotonic(), stats)
        self.pool.observe_workload(stats)

    async def _on_train_metrics(self, m: ev.TrainMetrics, _: Envelope) -> None:
        self.refitting.replanner.observe_step(time.monotonic(), m)
        self.pool.observe_step(m)

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
        if not await self.publisher.hold_lease():
            return
        await self.registration.expire()
        await self.registration.replace_gone(self._there, self.settings.gone_s, time.monotonic())
        await self.registration.promote_standby()
        await self.refitting.maybe_refit()
        if self.state.dirty:
            await self.publisher.publish()
        await self.moves.pool_moves()


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
