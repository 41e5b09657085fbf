"""The rollout-engine service shell: a `TurnServer` (`services/generation/serving.py`) on the job's
backend, with the WeightSync server its weights come through, the plan it follows and the hybrid
training side.

It loads the backend, starts the WeightSync server, announces itself to the planner and, once a
plan gives it the rollout (or hybrid) role, serves `turn.request.<worker_id>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from services.common import control, lending
from services.common.bus import Bus
from services.common.config import CommonSettings, load_settings
from services.common.contracts import ev
from services.common.membership import (
    HYBRID_ROLE,
    LENT_ROLE,
    PARKED_ROLE,
    SERVING_ROLES,
    SPARE_ROLE,
    Membership,
)
from services.common.runconfig import EngineJob, LearnJob, RunConfig
from services.generation.backends import create_backend
from services.generation.backends.emulated import EmulatedBackend
from services.generation.config import EngineSettings
from services.generation.serving import TurnServer
from services.rollout_engine.training_side import TrainingSide
from services.rollout_engine.weight_sync import WeightSyncServicer, start_server

SERVICE = "rollout-engine"


class RolloutEngineService(TurnServer):
    def __init__(self, common: CommonSettings, settings: EngineSettings, run: RunConfig):
        assert common.worker_id, "run_service sets the worker id"
        job = EngineJob.of(run)
        super().__init__(common.worker_id, settings, job, create_backend(job, settings), SERVICE)
        self.common = common
        self.run = run
        self.lend_switch_s = lending.switch_s(run)
        """What a move onto the trainer's GPUs costs (emulated; constant for the job)."""
        self._serving_role = asyncio.Event()
        self._closed = False
        self._hybrid_task: asyncio.Task[None] | None = None
        """The training side's run while the planner has this engine in the hybrid pool."""

    async def start(self, stop: asyncio.Event) -> None:
        """Loads the model, opens the servers and waits for an assignment (or `stop`)."""
        await self.backend.start()
        if self.backend.emulated:
            self.log.warning("emulated_backend", detail="outputs are random tokens; control-plane tests only")
        self.engine.start()
        self.store = self.common.ownership_store()
        self.servicer = WeightSyncServicer(
            self.engine,
            self.store,
            self.worker_id,
            self.settings.max_push_bytes,
            keep_tensors=not self.backend.emulated,
            relay_token=self.common.grpc_token(),
            relay_tls=self.common.tls(),
            record_timeout_s=self.settings.push_record_timeout_s,
            verifier=self.common.weight_verifier(),
        )
        self.server, port = await start_server(
            self.servicer,
            self.settings.grpc_host,
            self.settings.grpc_port,
            self.common.grpc_token(),
            self.common.tls(),
        )
        host = self.settings.advertise_host or self.settings.grpc_host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        self.weight_sync_addr = f"{host}:{port}"
        self.bus = await Bus.connect(
            self.common.nats_url,
            self.common.run_id,
            SERVICE,
            self.worker_id,
            self.common.nats_auth(),
            self.common.nats_tls(),
        )
        hello = ev.WorkerHello(
            worker_id=self.worker_id,
            kind=SERVICE,
            weight_sync_addr=self.weight_sync_addr,
            tensor_parallel=self.settings.tensor_parallel,
            preferred_bucket=self.settings.bucket,
        )
        self.training = TrainingSide(LearnJob.of(self.run), self.bus, self.worker_id, self._hybrid_token)
        await self.training.start()
        self.membership = Membership(self.bus, self.store, hello, on_plan=self._on_plan)
        await self.membership.start()
        control.set_detail(weight_sync_addr=self.weight_sync_addr, backend=self.backend.name)
        self.log.info(
            "engine_ready",
            backend=self.backend.name,
            emulated=self.backend.emulated,
            weight_sync_addr=self.weight_sync_addr,
            max_batch=self.engine.max_batch,
        )
        await self._wait_for_role(stop)
        if stop.is_set():
            return
        await self.open_turns()
        control.set_detail(bucket=self.bucket)
        self.log.info("serving", worker_id=self.worker_id, bucket=self.bucket)

    def holds_lease(self) -> bool:
        return self.membership.holds_lease()

    @property
    def tensor_parallel(self) -> int:
        return self.backend.tp if isinstance(self.backend, EmulatedBackend) else self.settings.tensor_parallel

    @property
    def bucket(self) -> str:
        a = self.membership.assignment
        return a.bucket if a is not None and a.bucket else self.settings.bucket

    def _hybrid_token(self) -> int | None:
        a = self.membership.assignment
        return a.fencing_token if a is not None and a.role == HYBRID_ROLE else None

    async def _on_plan(self, plan: ev.Plan) -> None:
        a = self.membership.assignment
        self.training.plan_changed()
        if a is not None and a.role == HYBRID_ROLE:
            if self._hybrid_task is None:
                start = time.monotonic()
                await self._drain()
                self._hybrid_task = self.bus.spawn(self._hybrid(a.fencing_token, time.monotonic() - start))
            return
        if self._hybrid_task is not None:
            return  # leaving training: it serves again once the trainer has let it go
        if a is not None and a.role in ("draining", SPARE_ROLE, PARKED_ROLE):
            if not self.draining:
                start = time.monotonic()
                handed_back = await self._drain()
                state = PARKED_ROLE if a.role == PARKED_ROLE else "drained"
                await self.training.state(
                    state, a.fencing_token, time.monotonic() - start, handed_back=handed_back
                )
            self._serving_role.set()  # a parked engine waits for its turn requests, refusing them
            return
        if a is not None and a.role == LENT_ROLE and self.draining:
            # the trainer's GPUs switch to rollout: what that costs, turns wait for (emulated)
            self._awake_at = time.monotonic() + self.lend_switch_s
        self.draining = False
        if a is not None and a.role in SERVING_ROLES:
            spec = next((b for b in plan.buckets if b.name == a.bucket), None)
            tp = a.tensor_parallel if a.role == LENT_ROLE else spec.tensor_parallel if spec else 0
            if isinstance(self.backend, EmulatedBackend):
                self.backend.weights_local = a.role == LENT_ROLE
                if tp > 0 and tp != self.backend.tp:
                    await self._restart_at_tp(tp)
            self._serving_role.set()
        elif a is not None:
            self.log.warning("not_a_rollout_role", role=a.role)

    async def _restart_at_tp(self, tp: int) -> None:
        """An emulated engine that the plan gives another TP pretends to span that many GPUs from
        now on. Once it has served, that is a restart on other GPUs, as a real engine's TP is fixed
        when it starts: it hands back the turns it holds (with their tokens, as a drained engine
        does) and serves again after loading the weights at the new TP (the cost model's
        `engine_load_s`, in wall time). Its first TP, before it served, costs nothing."""
        assert isinstance(self.backend, EmulatedBackend)
        if self.served_any:
            await self._drain()
            self.draining = False
            load = self.backend.cm.engine_load_s(tp) * self.backend.config.time_scale
            self._awake_at = max(self._awake_at, time.monotonic() + load)
            self.log.info("engine_tp_changed", source=self.backend.tp, target=tp, load_s=round(load, 3))
        self.backend.set_tensor_parallel(tp)

    async def _hybrid(self, token: int, drain_s: float) -> None:
        try:
            await self.training.run(token, drain_s)
        finally:
            self._hybrid_task = None
            if self.membership.plan is not None and not self.stopping:
                await self._on_plan(self.membership.plan)  # back to what the plan says now

    async def _wait_for_role(self, stop: asyncio.Event) -> None:
        waits = [asyncio.ensure_future(self._serving_role.wait()), asyncio.ensure_future(stop.wait())]
        timeout = self.settings.assignment_timeout_s or None
        done, pending = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        if not done:
            raise SystemExit(f"no plan assigned {self.worker_id} a rollout role within {timeout}s")

    async def shutdown(self, grace_s: float = 8.0) -> None:
        """Stops intake, finishes the running batch, hands queued requests back, then closes."""
        if self._closed:
            return
        self._closed = True
        self.log.info("engine_draining", waiting=self.engine.waiting, held=self.held)
        await self.close_turns(grace_s)
        if hasattr(self, "server"):
            await self.server.stop(grace=1.0)
        if hasattr(self, "membership"):
            await self.membership.release()
        if hasattr(self, "bus"):
            await self.bus.close()
        if hasattr(self, "store"):
            with contextlib.suppress(Exception):
                await self.store.close()
        await self.backend.close()


async def serve(
    common: CommonSettings, run: RunConfig, stop: asyncio.Event, stack: contextlib.AsyncExitStack
) -> None:
    settings = load_settings(EngineSettings)
    svc = RolloutEngineService(common, settings, run)
    stack.push_async_callback(svc.shutdown)
    await svc.start(stop)
    await stop.wait()
    await svc.shutdown()
