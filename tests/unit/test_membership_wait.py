"""A worker waiting for the plan that carried out its request (Membership.plan_at_least)."""

from __future__ import annotations

import asyncio
from typing import Any

from services.common.contracts import ev
from services.common.membership import Membership


async def test_waiting_for_a_plan_version_returns_once_it_is_applied_or_times_out() -> None:
    unused: Any = None  # applying a plan reads neither the bus nor the store
    m = Membership(unused, unused, ev.WorkerHello(worker_id="trainer-a", kind="trainer"))
    assert await m.plan_at_least(1, timeout=0.05) is False, "no plan yet"
    waiter = asyncio.create_task(m.plan_at_least(3, timeout=5.0))
    await m._apply(ev.Plan(plan_version=2, planner_epoch=1))
    await asyncio.sleep(0.05)
    assert not waiter.done(), "version 2 is not 3"
    await m._apply(ev.Plan(plan_version=3, planner_epoch=1))
    assert await waiter is True
    assert await m.plan_at_least(2, timeout=0.05) is True, "an older version: at once"
    await m._apply(ev.Plan(plan_version=9, planner_epoch=0))  # from a planner fenced out: refused
    assert await m.plan_at_least(9, timeout=0.05) is False
