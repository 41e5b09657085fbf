"""The planner shell on real NATS and Redis: it leases workers, publishes plans with buckets, hands
the trainer role to a standby when the lease runs out, and outlives a Redis restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import ev
from services.common.localstack import Server, start_redis
from services.common.membership import TRAINER_ROLE, lease_resource
from services.common.ownership import Lease, OwnershipStore
from services.common.runconfig import RunConfig
from services.planner.config import PlannerSettings
from services.planner.service import PlannerService

pytestmark = pytest.mark.integration


@pytest.fixture
async def rig(nats_server: Server, run_id: str, tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    redis = start_redis(tmp_path / "redis")  # its own: this test restarts it
    store = OwnershipStore.from_url(redis.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "planner", "planner")
    watcher = await Bus.connect(nats_server.url, run_id, "test", "watcher")
    plans: list[ev.Plan] = []

    async def on_plan(p: ev.Plan, _: Envelope) -> None:
        plans.append(p)

    await watcher.subscribe(subjects.PLAN, ev.Plan, on_plan)
    cfg = RunConfig.model_validate({"job": {"lease_ttl_s": 2.0}})
    planner = PlannerService(PlannerSettings(tick_s=0.1), cfg, bus, store)
    await planner.start()
    try:
        yield {"planner": planner, "store": store, "watcher": watcher, "plans": plans, "redis": redis}
    finally:
        for b in (bus, watcher):
            await b.close()
            await b.nc.close()
        await store.close()
        redis.stop()


async def _until(what: str, cond: Any, timeout: float = 15.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.05)


def _roles(plan: ev.Plan) -> dict[str, str]:
    return {a.worker_id: a.role for a in plan.assignments}


async def test_standby_takes_the_trainer_role_and_the_planner_outlives_redis(rig: dict[str, Any]) -> None:
    watcher, plans, store = rig["watcher"], rig["plans"], rig["store"]
    for wid in ("trainer-a", "trainer-b", "engine-0"):
        kind = "rollout-engine" if wid.startswith("engine") else "trainer"
        await watcher.publish(
            subjects.WORKER_HELLO, ev.WorkerHello(worker_id=wid, kind=kind, weight_sync_addr="x:1")
        )
    await _until("plan", lambda: plans and len(plans[-1].assignments) == 3)
    plan = plans[-1]
    assert _roles(plan) == {"trainer-a": "train", "trainer-b": "standby", "engine-0": "rollout"}
    assert [(b.name, b.tensor_parallel) for b in plan.buckets] == [("short", 1)] and plan.lease_ttl_s == 2.0

    # Redis goes away and comes back (same port and data): the planner's loop lives on
    rig["redis"].proc.kill()
    rig["redis"].proc.wait()
    await asyncio.sleep(0.5)  # a few ticks fail meanwhile
    rig["redis"].restart()

    # the engine and the standby keep renewing what the latest plan gives them; trainer-a does not
    # (it died): its lease runs out and trainer-b takes the role under a new token
    async def live_workers() -> None:
        while True:
            for a in plans[-1].assignments:
                if a.worker_id in ("engine-0", "trainer-b"):
                    lease = Lease(lease_resource(a.role, a.worker_id), a.worker_id, a.fencing_token)
                    await store.renew(lease, 2.0)
            await asyncio.sleep(0.3)

    keeper = asyncio.create_task(live_workers())
    try:
        await _until("takeover", lambda: _roles(plans[-1]).get("trainer-b") == "train", timeout=20)
    finally:
        keeper.cancel()
    final = plans[-1]
    assert _roles(final) == {"trainer-b": "train", "engine-0": "rollout"}
    held = await store.holder(TRAINER_ROLE)
    token_b = next(a.fencing_token for a in final.assignments if a.worker_id == "trainer-b")
    assert held is not None and held.owner == "trainer-b" and held.token == token_b
