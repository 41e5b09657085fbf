"""A worker cut off from NATS while the planner publishes a plan follows that plan once it is back.

Plans go out on core NATS (and are kept on a last-value stream): one published while a worker's
connection was down never reaches its subscription, and the planner publishes again only when the
plan changes. Seen in the chaos test: an engine re-registered while nats-server restarted, the
scheduler and the trainer reconnected after the plan naming it went out, and the job stalled with
that engine left out of every push and every route. Here a real nats-server, and a TCP proxy
between it and one worker that cuts the worker off (a partition) and lets it back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import pytest

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.membership import Membership
from services.common.ownership import OwnershipStore

pytestmark = pytest.mark.integration


class Partition:
    """A TCP proxy in front of `upstream`: `cut` drops the connections through it and refuses new
    ones, `heal` lets them through again."""

    def __init__(self, upstream: str):
        host, port = upstream.removeprefix("nats://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.open = True
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.url = f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        self.open = False
        for w in self._writers:
            w.close()
        self._writers.clear()

    def heal(self) -> None:
        self.open = True

    async def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()


async def _until(what: str, cond: Callable[[], bool], timeout_s: float = 15.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not cond():
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"{what}: not within {timeout_s:g} s")


def _plan(version: int, token: int) -> ev.Plan:
    return ev.Plan(
        plan_version=version,
        planner_epoch=1,
        reason="test",
        assignments=[
            ev.Assignment(worker_id="engine-0", role="rollout", bucket="short", fencing_token=token)
        ],
    )


async def test_a_worker_cut_off_while_a_plan_went_out_follows_it_once_back(
    nats_server, redis_server, run_id
) -> None:
    proxy = Partition(nats_server.url)
    await proxy.start()
    planner = await Bus.connect(nats_server.url, run_id, "planner", "planner")
    worker = await Bus.connect(proxy.url, run_id, "rollout-engine", "engine-0")
    store = OwnershipStore.from_url(redis_server.url, run_id)
    member = Membership(worker, store, ev.WorkerHello(worker_id="engine-0", kind="rollout-engine"))
    try:
        await member.start()
        await planner.publish_durable(subjects.PLAN, _plan(1, 1), msg_id="p1")
        await _until(
            "the first plan heard", lambda: member.plan is not None and member.plan.plan_version == 1
        )

        proxy.cut()
        await _until("the worker knows it is cut off", lambda: not worker.nc.is_connected)
        # the planner re-registers the worker under a new token while it cannot hear
        await planner.publish_durable(subjects.PLAN, _plan(2, 2), msg_id="p2")
        await asyncio.sleep(0.5)
        assert member.plan is not None and member.plan.plan_version == 1

        proxy.heal()
        await _until("the plan published in the gap followed", lambda: member.plan.plan_version == 2)  # type: ignore[union-attr]
        assert worker.reconnects == 1
        assert member.assignment is not None and member.assignment.fencing_token == 2
        # and a plan published after it is back arrives as ever
        await planner.publish_durable(subjects.PLAN, _plan(3, 2), msg_id="p3")
        await _until("the next plan heard", lambda: member.plan.plan_version == 3)  # type: ignore[union-attr]
    finally:
        for b in (worker, planner):
            await b.close()
        await proxy.close()
        await store.close()
