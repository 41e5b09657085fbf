"""The scheduler's one registry of tool calls out at the sandbox: a trajectory's, or a reward's."""

from __future__ import annotations

import asyncio

from services.common.contracts import ev
from services.scheduler.tool_calls import ToolCalls


async def test_a_return_finds_its_caller_once_whoever_waits() -> None:
    calls = ToolCalls()
    fut: asyncio.Future[ev.ToolReturn] = asyncio.get_running_loop().create_future()
    calls.expect("c-traj", "traj-1")
    calls.expect("c-reward", fut)
    assert "c-traj" in calls and "c-reward" in calls
    assert calls.answered(ev.ToolReturn(call_id="c-traj")) == "traj-1"
    assert calls.answered(ev.ToolReturn(call_id="c-traj")) is None, "a second return finds nobody"
    ret = ev.ToolReturn(call_id="c-reward", status="ok")
    assert calls.answered(ret) is None and fut.result() == ret
    calls.expect("c-gone", "traj-2")
    calls.forget("c-gone")
    assert "c-gone" not in calls and calls.answered(ev.ToolReturn(call_id="c-gone")) is None
    assert calls.answered(ev.ToolReturn(call_id="not-ours")) is None
