"""The tool-sandbox service over real NATS: typed returns for good, bad and hostile calls, and it
keeps serving afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import ev
from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.executor import SandboxExecutor
from services.tool_sandbox.service import ToolSandboxService

pytestmark = pytest.mark.integration


async def test_service_answers_and_survives(nats_server, run_id) -> None:
    executor = SandboxExecutor(SandboxSettings())
    await executor.start()
    svc_bus = await Bus.connect(nats_server.url, run_id, "tool-sandbox", "sandbox-0")
    client = await Bus.connect(nats_server.url, run_id, "test", "client")
    returns: dict[str, ev.ToolReturn] = {}
    got = asyncio.Event()

    async def on_return(r: ev.ToolReturn, _: Envelope) -> None:
        returns[r.call_id] = r
        got.set()

    try:
        await ToolSandboxService(svc_bus, executor).start()
        await client.subscribe(subjects.TOOL_RETURN, ev.ToolReturn, on_return)
        await client.nc.publish(client.subject(subjects.TOOL_CALL), b"\xff\x00 not protobuf")
        calls = {
            "calc": ev.ToolCall(
                call_id="calc", tool="calculator", args_json=json.dumps({"expression": "12*7+5"})
            ),
            "badjson": ev.ToolCall(call_id="badjson", tool="python", args_json="{not json"),
            "unknown": ev.ToolCall(call_id="unknown", tool="rm-rf", args_json="{}"),
            "loop": ev.ToolCall(
                call_id="loop", tool="python", args_json=json.dumps({"code": "while True: pass"}), timeout_s=1
            ),
            "after": ev.ToolCall(
                call_id="after", tool="python", args_json=json.dumps({"code": "print(6*7)"})
            ),
        }
        for call in calls.values():
            await client.publish(subjects.TOOL_CALL, call)
        for _ in range(200):
            if len(returns) == len(calls):
                break
            await asyncio.sleep(0.1)
        assert set(returns) == set(calls)
        assert returns["calc"].status == "ok" and "89" in returns["calc"].payload
        assert returns["badjson"].status == "rejected" and returns["badjson"].error
        assert returns["unknown"].status == "rejected"
        assert returns["loop"].status in ("timeout", "killed")
        assert returns["after"].status == "ok" and "42" in returns["after"].payload
        assert returns["after"].size_class == "small" and returns["after"].payload_bytes > 0
        assert svc_bus.rejected >= 1  # the garbage was reported, not fatal
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        await svc_bus.close()
        await executor.close()


async def test_code_tests_reward_runs_in_the_real_sandbox(nats_server, run_id, monkeypatch) -> None:
    """The `code_tests` built-in reward: the response's code and the row's tests in the sandbox."""
    from services.scheduler import rewards
    from services.scheduler.plugins import PluginFailure
    from services.scheduler.rewards import SandboxClient, code_tests
    from services.scheduler.tool_calls import ToolCalls

    executor = SandboxExecutor(SandboxSettings())
    await executor.start()
    svc_bus = await Bus.connect(nats_server.url, run_id, "tool-sandbox", "sandbox-0")
    bus = await Bus.connect(nats_server.url, run_id, "scheduler", "scheduler-0")
    calls = ToolCalls()
    client = SandboxClient(bus, calls)

    async def on_return(r: ev.ToolReturn, _: Envelope) -> None:
        calls.answered(r)

    good = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    sample = {"tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}
    try:
        await ToolSandboxService(svc_bus, executor).start()
        await bus.subscribe(subjects.TOOL_RETURN, ev.ToolReturn, on_return)
        assert await code_tests(good, sample, client, 10) == 1.0
        assert await code_tests(wrong, sample, client, 10) == 0.0
        assert await code_tests("no code at all", sample, client, 10) == 0.0
        assert await code_tests("```python\nwhile True: pass\n```", sample, client, 1) == 0.0  # too slow
        missing = await code_tests(good, {"answer": 1}, client, 10)
        assert isinstance(missing, PluginFailure) and missing.code == "reward_error"
        await svc_bus.close()  # no sandbox left: a failure of the reward, not a 0
        monkeypatch.setattr(rewards, "SANDBOX_GRACE_S", 0.5)
        gone = await code_tests(good, sample, client, 0.5)
        assert isinstance(gone, PluginFailure) and gone.code == "reward_timeout"
        assert len(calls) == 0, "a reward's call that timed out leaves nothing waiting"
    finally:
        with contextlib.suppress(Exception):
            await bus.close()
        with contextlib.suppress(Exception):
            await svc_bus.close()
        await executor.close()
