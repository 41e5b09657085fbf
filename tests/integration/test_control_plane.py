"""The job control plane on a real nats-server: a service's JobAgent takes one job at a time,
refuses bad ones with a typed error, reports a job that failed inside it, and is idle again after a
stop. The `serve` here is a stand-in whose behaviour each test chooses; the agent is the real one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from services.common import control
from services.common.bus import close_nats
from services.common.config import CommonSettings
from services.common.contracts import ev
from services.common.errors import UserCodeBroken
from services.common.localstack import Server
from services.common.runconfig import RunConfig, parse_run_config

pytestmark = pytest.mark.integration

GOOD = "name: t\nmodel: {source: tiny-random}\ntraining: {steps: 1}\n"


class Probe:
    """Records what the agent asked of `serve`."""

    def __init__(self) -> None:
        self.started: list[CommonSettings] = []
        self.runs: list[RunConfig] = []
        self.closed = 0
        self.fail_with: Exception | None = None

    async def serve(
        self, common: CommonSettings, run: RunConfig, stop: asyncio.Event, stack: contextlib.AsyncExitStack
    ) -> None:
        self.started.append(common)
        self.runs.append(run)

        async def closed() -> None:
            self.closed += 1

        stack.push_async_callback(closed)
        if self.fail_with is not None:
            raise self.fail_with
        await stop.wait()


@pytest.fixture
async def plane(nats_server: Server) -> AsyncIterator[tuple[Probe, NATS, Callable[[], Any]]]:
    probe = Probe()
    common = CommonSettings(nats_url=nats_server.url, worker_id="svc-under-test")
    agent = control.JobAgent("scheduler", common, probe.serve, grace_s=2)
    stop = asyncio.Event()
    task = asyncio.ensure_future(agent.run(stop))
    nc = await control.connect(nats_server.url, "test")
    for _ in range(50):
        if any(s.worker_id == "svc-under-test" for s in await control.discover(nc, 0.1)):
            break
    yield probe, nc, agent.status
    stop.set()
    await asyncio.wait_for(task, 10)
    await close_nats(nc)


async def _start(nc: NATS, run_id: str, yaml_text: str = GOOD) -> ev.JobAck:
    spec = ev.JobSpec(run_id=run_id, config_yaml=yaml_text, targets=["svc-under-test"])
    acks = await control.command(nc, control.JOB_START, spec, ["svc-under-test"], timeout_s=5)
    return acks["svc-under-test"]


async def _stop(nc: NATS, run_id: str) -> ev.JobAck:
    acks = await control.command(nc, control.JOB_STOP, ev.JobStop(run_id=run_id), ["svc-under-test"], 5)
    return acks["svc-under-test"]


async def test_one_job_at_a_time_then_idle(plane: tuple[Probe, NATS, Callable[[], Any]]) -> None:
    probe, nc, status = plane
    assert (await _start(nc, "run-1")).ok
    assert (await _start(nc, "run-1")).ok  # a resent start is acknowledged, not started twice
    busy = await _start(nc, "run-2")
    assert not busy.ok and busy.error.code == "busy" and "run-1" in busy.error.message
    await asyncio.sleep(0.1)
    assert [c.run_id for c in probe.started] == ["run-1"]
    assert probe.runs[0] == parse_run_config(GOOD, "the job") and probe.started[0].config is None
    st = status()
    assert (st.state, st.run_id) == ("running", "run-1")
    assert (await _stop(nc, "run-1")).ok
    assert probe.closed == 1 and status().state == "idle"
    assert (await _start(nc, "run-2")).ok  # the next job
    assert [c.run_id for c in probe.started] == ["run-1", "run-2"]
    assert (await _stop(nc, "run-2")).ok


async def test_bad_jobs_are_refused_with_a_typed_error(plane: tuple[Probe, NATS, Callable[[], Any]]) -> None:
    probe, nc, status = plane
    for yaml_text, run_id in [
        ("training: {steps: 0}\n", "run-ok"),  # fails validation
        ("{not yaml", "run-ok"),
        ("- a list\n", "run-ok"),
        (GOOD, "bad.run.id"),  # would break the subject scheme
    ]:
        ack = await _start(nc, run_id, yaml_text)
        assert not ack.ok and ack.error.code == "invalid", (yaml_text, ack)
    for garbage in (b"\xff\x00junk", b"\x08" * 7):  # not even a JobSpec: ignored, the agent serves on
        await nc.publish(control.JOB_START, garbage)
        await nc.publish(control.JOB_STOP, garbage)
    assert probe.started == [] and status().state == "idle"
    assert (await _start(nc, "run-ok")).ok
    assert (await _stop(nc, "run-ok")).ok


async def test_a_job_that_fails_inside_the_service_is_reported(
    plane: tuple[Probe, NATS, Callable[[], Any]],
) -> None:
    probe, nc, status = plane
    probe.fail_with = RuntimeError("model file is corrupt")
    assert (await _start(nc, "run-f")).ok
    for _ in range(50):
        if status().state == "failed":
            break
        await asyncio.sleep(0.05)
    st = status()
    assert st.state == "failed" and st.error.code == "internal" and "corrupt" in st.error.message
    heard = [s for s in await control.discover(nc, 0.3) if s.worker_id == "svc-under-test"]
    assert heard and heard[0].state == "failed"
    assert (await _stop(nc, "run-f")).ok
    assert status().state == "idle" and probe.closed == 1

    # a typed end (the job's own reward fails on every call) keeps its code
    probe.fail_with = UserCodeBroken("20 trajectories in a row failed (reward_error): TypeError")
    assert (await _start(nc, "run-u")).ok
    for _ in range(50):
        if status().state == "failed":
            break
        await asyncio.sleep(0.05)
    st = status()
    assert st.state == "failed" and st.error.code == "user_code" and "TypeError" in st.error.message
    assert (await _stop(nc, "run-u")).ok


async def test_agents_sharing_a_process_each_run_their_own_job(nats_server: Server) -> None:
    """As in an engine host: two agents in one event loop, each in its own task, report their own
    job's detail and give `serve` their own settings."""
    seen: dict[str, CommonSettings] = {}

    async def serve(
        common: CommonSettings, run: RunConfig, stop: asyncio.Event, stack: contextlib.AsyncExitStack
    ) -> None:
        assert common.worker_id is not None
        seen[common.worker_id] = common
        control.set_detail(mine=common.worker_id)
        await stop.wait()

    agents = [
        control.JobAgent(
            "scheduler", CommonSettings(nats_url=nats_server.url, worker_id=w, redis_user=w), serve
        )
        for w in ("svc-a", "svc-b")
    ]
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(a.run(stop)) for a in agents]
    nc = await control.connect(nats_server.url, "test")
    try:
        for _ in range(50):
            if len({s.worker_id for s in await control.discover(nc, 0.1)} & {"svc-a", "svc-b"}) == 2:
                break
        spec = ev.JobSpec(run_id="run-h", config_yaml=GOOD, targets=["svc-a", "svc-b"])
        acks = await control.command(nc, control.JOB_START, spec, ["svc-a", "svc-b"], timeout_s=5)
        assert all(a.ok for a in acks.values()) and set(acks) == {"svc-a", "svc-b"}
        for _ in range(50):
            if len(seen) == 2 and all(a.status().detail for a in agents):
                break
            await asyncio.sleep(0.05)
        assert {w: (c.run_id, c.redis_user) for w, c in seen.items()} == {
            "svc-a": ("run-h", "svc-a"),
            "svc-b": ("run-h", "svc-b"),
        }
        assert [dict(a.status().detail) for a in agents] == [{"mine": "svc-a"}, {"mine": "svc-b"}]
        await control.command(nc, control.JOB_STOP, ev.JobStop(run_id="run-h"), ["svc-a", "svc-b"], 5)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await close_nats(nc)
