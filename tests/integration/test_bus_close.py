"""Closing a bus whose pull consumer has unfetched messages and expired pulls logs nothing and leaves
nothing behind (a drain used to hang on them and, cancelled, leave a gather whose CancelledError was
'never retrieved' on every trainer shutdown)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.localstack import Server
from services.common.streams import TRAINER_FEED

pytestmark = pytest.mark.integration


async def test_close_with_unfetched_pull_messages(nats_server: Server, run_id: str) -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, ctx: reported.append(ctx))
    try:
        bus = await Bus.connect(nats_server.url, run_id, "trainer", "t0")
        psub, _ = await bus.bind_consumer(TRAINER_FEED)
        for i in range(3):
            await bus.publish_durable(subjects.TRAJ_COMPLETED, ev.CompletedTrajectory(), msg_id=f"m{i}")
        got = await bus.fetch(psub, ev.CompletedTrajectory, 1, 2.0)  # one fetched, two left on the wire
        assert len(got) == 1
        await bus.fetch(psub, ev.CompletedTrajectory, 8, 0.2)
        await bus.fetch(psub, ev.CompletedTrajectory, 8, 0.2)  # an expired pull leaves a status behind

        async def noop(_: Any, __: Any) -> None:
            return None

        await bus.subscribe(subjects.PLAN, ev.Plan, noop)
        await asyncio.wait_for(bus.close(), timeout=10)
        assert bus.nc.is_closed
        for _ in range(3):
            gc.collect()
            await asyncio.sleep(0.1)
    finally:
        loop.set_exception_handler(previous)
    assert not [c for c in reported if "never retrieved" in str(c.get("message", ""))], reported
