"""The stack's job control plane, on NATS subjects `libra.ctl.v1.*` (outside every run's scope).

`libra up` starts each service without a job. The service's `JobAgent` beats a heartbeat (at once
when asked for status), and runs one job at a time: `libra run` sends a `JobSpec` (run id and run config)
naming the workers that take part, watches the job, and ends it with a `JobStop`; the service then
waits for the next job. A job that fails inside a service is reported in that service's status
(with the error) and the service stays up. A worker's heartbeats and acks go out on its own
subjects (`heartbeat.<kind>.<worker_id>`, `ack.<kind>.<worker_id>`), which only its NATS user may
publish to, so no service can report another's status or answer for it. A service started with `LIBRA_CONFIG` set (the container
deployments) runs that one job from the start instead and never looks at this plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.common.bus import M, close_nats, decode, said_by
from services.common.bus import connect_nats as connect
from services.common.config import ID_PATTERN, CommonSettings, ConfigFileError
from services.common.contracts import ev
from services.common.errors import FencedOut, ForgedSender, LibraError, MalformedMessage
from services.common.logging import get_logger
from services.common.runconfig import RunConfig, parse_run_config
from services.common.tasks import cancel_and_wait
from services.common.tracing import set_trace_file

CTL = "libra.ctl.v1"
JOB_START = f"{CTL}.job.start"
JOB_STOP = f"{CTL}.job.stop"
STATUS = f"{CTL}.status"
HEARTBEAT = f"{CTL}.heartbeat"  # .<kind>.<worker_id>
ACK = f"{CTL}.ack"  # .<kind>.<worker_id>
HEARTBEAT_S = 2.0

Serve = Callable[[CommonSettings, RunConfig, asyncio.Event, contextlib.AsyncExitStack], Awaitable[None]]
"""One job of a service: its settings, the job's parsed run config, the stop event, the exit stack."""

_detail: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("libra_job_detail")
"""The detail of the agent whose task this is: one per agent, so that the agents of an engine host
(services/rollout_engine/host.py), each in its own task, report their own."""

RUN_ID = re.compile(ID_PATTERN)


def set_detail(**values: object) -> None:
    """What the running job's service wants a watcher to see (shown in stall reports, not trusted)."""
    detail = _detail.get(None)
    if detail is not None:
        detail.update({k: str(v) for k, v in values.items()})


@dataclass
class Job:
    spec: ev.JobSpec
    common: CommonSettings
    run: RunConfig
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Future[None] | None = None
    error: ev.ErrorInfo | None = None


class JobAgent:
    """A service's side of the control plane: idle → running one job → idle, until the process stops."""

    def __init__(
        self,
        service: str,
        common: CommonSettings,
        serve: Serve,
        *,
        grace_s: float = 10.0,
        trace_files: bool = True,
    ):
        assert common.worker_id is not None
        self.service = service
        self.worker_id = common.worker_id
        self.common = common
        self.serve = serve
        self.grace_s = grace_s
        self.trace_files = trace_files
        """Write each job's spans to the file its spec names (the process's one trace file: off
        where several agents share a process, whose spans then go to OTLP only)."""
        self.job: Job | None = None
        self.detail: dict[str, str] = {}
        self.log = get_logger(component="control")
        self.nc: NATS | None = None

    async def run(self, stop: asyncio.Event) -> None:
        _detail.set(self.detail)  # this task's: its subscriptions and jobs inherit it
        self.nc = await connect(
            self.common.nats_url,
            f"{self.service}:{self.worker_id}:control",
            self.common.nats_auth(),
            self.common.nats_tls(),
        )
        await self.nc.subscribe(JOB_START, cb=self._on_start)
        await self.nc.subscribe(JOB_STOP, cb=self._on_stop)
        await self.nc.subscribe(STATUS, cb=self._on_status)
        await self.nc.flush()
        self.log.info("waiting_for_job")
        beat = asyncio.ensure_future(self._heartbeat())
        try:
            await stop.wait()
        finally:
            await cancel_and_wait([beat])
            if self.job is not None:
                await self._end(self.job, "service stopping")
            await close_nats(self.nc)

    def status(self) -> ev.WorkerStatus:
        job = self.job
        st = ev.WorkerStatus(
            worker_id=self.worker_id, service=self.service, pid=os.getpid(), host=socket.gethostname()
        )
        if job is None:
            st.state = "idle"
            return st
        st.run_id = job.spec.run_id
        st.state = "failed" if job.error else "stopping" if job.stop.is_set() else "running"
        if job.error is not None:
            st.error.CopyFrom(job.error)
        st.detail.update(self.detail)
        return st

    async def _publish_status(self) -> None:
        if self.nc is not None and self.nc.is_connected:
            await self.nc.publish(self._mine(HEARTBEAT), self.status().SerializeToString())

    def _mine(self, base: str) -> str:
        return f"{base}.{self.service}.{self.worker_id}"

    async def _heartbeat(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self._publish_status()
            await asyncio.sleep(HEARTBEAT_S)

    async def _reply(self, ack: ev.JobAck) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.publish(self._mine(ACK), ack.SerializeToString())
                await self.nc.flush(timeout=2)  # before the job's start-up can hold the loop

    def _ack(self, run_id: str, error: ev.ErrorInfo | None = None) -> ev.JobAck:
        ack = ev.JobAck(worker_id=self.worker_id, service=self.service, run_id=run_id, ok=error is None)
        if error is not None:
            ack.error.CopyFrom(error)
        return ack

    async def _on_status(self, _: Msg) -> None:
        with contextlib.suppress(Exception):
            await self._publish_status()

    def _decoded(self, msg: Msg, msg_type: type[M]) -> M | None:
        """The message, or None (logged) when it is not one: the agent serves on."""
        try:
            return decode(msg_type, msg.data)
        except MalformedMessage as err:
            self.log.warning("message_rejected", subject=msg.subject, code=err.code, reason=str(err))
            return None

    async def _on_start(self, msg: Msg) -> None:
        spec = self._decoded(msg, ev.JobSpec)
        if spec is None:
            return
        if spec.targets and self.worker_id not in spec.targets:
            return
        job = self.job
        if job is not None:
            busy = None
            if job.spec.run_id != spec.run_id:
                busy = ev.ErrorInfo(code="busy", message=f"{self.worker_id} is running job {job.spec.run_id}")
            await self._reply(self._ack(spec.run_id, busy))  # a resent start is acknowledged again
            return
        try:
            job = self._prepare(spec)
        except ConfigFileError as err:
            self.log.warning("job_refused", run_id=spec.run_id, reason=err.message)
            await self._reply(self._ack(spec.run_id, ev.ErrorInfo(code="invalid", message=err.message)))
            return
        self.detail.clear()
        self.job = job
        job.task = asyncio.ensure_future(self._run(job))
        await self._reply(self._ack(spec.run_id))

    def _prepare(self, spec: ev.JobSpec) -> Job:
        """Validates the job's run id and parses its config, once: `serve` gets the parsed config
        and this agent's settings (its own credentials) scoped to the job's run."""
        if not RUN_ID.fullmatch(spec.run_id):
            raise ConfigFileError(f"run id {spec.run_id!r}: letters, digits, '-' and '_' only, at most 64")
        where = f"job {spec.run_id!r} config ({spec.config_name or 'sent over the bus'})"
        run = parse_run_config(spec.config_yaml, where)
        common = self.common.model_copy(update={"run_id": spec.run_id, "config": None})
        return Job(spec, common, run)

    async def _run(self, job: Job) -> None:
        structlog.contextvars.bind_contextvars(run_id=job.spec.run_id)
        self.log.info("job_started", config=job.spec.config_name)
        traced = self.trace_files and job.spec.trace_dir
        trace_file = Path(job.spec.trace_dir) / f"{self.worker_id}.jsonl" if traced else None
        if self.trace_files:
            set_trace_file(trace_file)
        try:
            await self._serve(job)
        except asyncio.CancelledError:
            raise
        except ConfigFileError as err:  # a SystemExit: caught here, or asyncio would end the process
            job.error = ev.ErrorInfo(code="invalid", message=err.message)
        except LibraError as err:  # a typed end: the job cannot go on, and says why
            job.error = ev.ErrorInfo(code=err.code, message=str(err)[:2000])
        except Exception as err:
            self.log.exception("job_failed")
            job.error = ev.ErrorInfo(code="internal", message=f"{type(err).__name__}: {err}"[:2000])
        if trace_file is not None:
            await asyncio.to_thread(set_trace_file, None)  # flushes the job's last spans to its file
        if job.error is not None:
            self.log.error("job_failed", code=job.error.code, reason=job.error.message)
            with contextlib.suppress(Exception):
                await self._publish_status()
        else:
            self.log.info("job_finished")

    async def _serve(self, job: Job) -> None:
        """The job, from the start again (everything it held closed first) each time this worker is
        fenced out of its role: it rejoins as a standby, its successor's state being the job's."""
        while True:
            try:
                async with contextlib.AsyncExitStack() as stack:
                    await self.serve(job.common, job.run, job.stop, stack)
                return
            except FencedOut as err:
                if job.stop.is_set():
                    return
                self.log.warning("job_rejoined_as_standby", reason=str(err))

    async def _on_stop(self, msg: Msg) -> None:
        spec = self._decoded(msg, ev.JobStop)
        if spec is None:
            return
        job = self.job
        if job is not None and job.spec.run_id == spec.run_id:
            await self._end(job, spec.reason or "stopped by the job's owner")
        await self._reply(self._ack(spec.run_id))  # stopping a job this worker is not running is a no-op

    async def _end(self, job: Job, reason: str) -> None:
        self.log.info("job_stopping", run_id=job.spec.run_id, reason=reason)
        job.stop.set()
        if job.task is not None:
            done, _ = await asyncio.wait({job.task}, timeout=self.grace_s)
            if not done:
                self.log.warning("job_stop_timeout", grace_s=self.grace_s)
                await cancel_and_wait([job.task])
        if self.job is job:
            self.job = None
        self.log.info("job_stopped", run_id=job.spec.run_id)


def heard(raw: Msg, msg_type: type[M]) -> M | None:
    """A heartbeat or ack as its worker sent it, or None: not one, or naming another worker."""
    try:
        msg = decode(msg_type, raw.data)
        said_by(raw.subject, msg)
    except (MalformedMessage, ForgedSender) as err:
        get_logger(component="control").warning(
            "message_rejected", subject=raw.subject, code=err.code, reason=str(err)
        )
        return None
    return msg


async def discover(nc: NATS, wait_s: float = 1.0) -> list[ev.WorkerStatus]:
    """Asks every service on the plane for its status and collects their heartbeats for `wait_s`."""
    found: dict[str, ev.WorkerStatus] = {}

    async def on_beat(raw: Msg) -> None:
        st = heard(raw, ev.WorkerStatus)
        if st is not None:
            found[st.worker_id] = st

    sub = await nc.subscribe(f"{HEARTBEAT}.*.*", cb=on_beat)
    try:
        await nc.publish(STATUS, b"")
        await asyncio.sleep(wait_s)
    finally:
        await sub.unsubscribe()
    return list(found.values())


async def command(
    nc: NATS, subject: str, msg: Any, targets: list[str], timeout_s: float, resend_s: float = 2.0
) -> dict[str, ev.JobAck]:
    """Sends a start/stop of `msg.run_id` to `targets` (resending to those that have not answered)
    and collects their acks."""
    acks: dict[str, ev.JobAck] = {}
    all_in = asyncio.Event()

    async def on_ack(raw: Msg) -> None:
        ack = heard(raw, ev.JobAck)
        if ack is not None and ack.run_id == msg.run_id and ack.worker_id in targets:
            acks[ack.worker_id] = ack
            if len(acks) == len(targets):
                all_in.set()

    sub = await nc.subscribe(f"{ACK}.*.*", cb=on_ack)
    await nc.flush()
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while not all_in.is_set():
            await nc.publish(subject, msg.SerializeToString())
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_in.wait(), min(resend_s, left))
    finally:
        await sub.unsubscribe()
    return acks
