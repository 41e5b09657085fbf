"""Agents in the tool sandbox (`task.agent_sandbox`), on real NATS with the stack's credentials
(each side only its role's grants), real bubblewrap sandboxes and a real HTTP endpoint: the agent
reaches its endpoint with its trajectory's key through the sandbox's bridge, and nothing else of
the network or this host; a hung, cancelled or broken agent fails its run with a typed reason."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from services.common.bus import Bus
from services.common.credentials import StackCredentials, generate
from services.common.localstack import Server
from services.scheduler import sandboxed_agents
from services.scheduler.plugins import PluginFailure
from services.scheduler.sandboxed_agents import SandboxedAgents
from services.tool_sandbox.agents import AgentJob, AgentSandboxes
from services.tool_sandbox.config import SandboxSettings
from services.tool_sandbox.executor import SandboxExecutor
from services.tool_sandbox.service import ToolSandboxService
from tests.secured import secured_nats

pytestmark = pytest.mark.integration

AGENT = """
import json, os, socket

def agent(sample, base_url, api_key):
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model="m", messages=[{{"role": "user", "content": sample["q"]}}])
    seen = {{"reply": reply.choices[0].message.content, "host": socket.gethostname()}}
    try:  # a port open on this host's loopback: the sandbox's loopback is its own
        socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
        seen["host_port"] = "reached"
    except OSError:
        seen["host_port"] = "unreachable"
    seen["secret"] = os.path.exists({secret!r})
    seen["libra_env"] = sorted(k for k in os.environ if k.startswith("LIBRA") or k.startswith("OPENAI"))
    try:
        open(os.path.join(os.path.dirname(__file__), "planted"), "w")
        seen["code"] = "writable"
    except OSError:
        seen["code"] = "read-only"
    client.chat.completions.create(model="m", messages=[{{"role": "user", "content": json.dumps(seen)}}])
    return 0.5


def hang(sample, base_url, api_key):
    import time
    time.sleep(3600)


def broken(sample, base_url, api_key):
    return "five"
"""

COMMAND = """
import json, os, sys
from openai import OpenAI

row = json.loads(sys.stdin.read())
assert row == json.loads(os.environ["LIBRA_SAMPLE"])
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY, as any OpenAI program reads them
client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["q"] + " " + os.getcwd()}])
print("thinking")
print(0.25)
"""


@dataclass
class Endpoint:
    """The scheduler's endpoint as the bridge meets it: chat completions, each call recorded."""

    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    base_url: str = ""

    async def chat(self, request: web.Request) -> web.Response:
        key = request.headers.get("Authorization", "").removeprefix("Bearer ")
        body = await request.json()
        self.calls.append((key, body))
        message = {"role": "assistant", "content": f"hi {key}"}
        choice = {"index": 0, "finish_reason": "stop", "message": message}
        usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "m",
                "choices": [choice],
                "usage": usage,
            }
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, StackCredentials]]:
    """nats-server with a stack's users, each allowed what its role needs."""
    creds = generate(tmp_path_factory.mktemp("stack") / "secrets")
    with secured_nats(creds, tmp_path_factory) as srv:
        yield srv, creds


@dataclass
class Rig:
    endpoint: Endpoint
    agents: SandboxedAgents
    sandboxes: AgentSandboxes
    host_port: int
    secret: Path


@pytest.fixture
async def rig(
    request: pytest.FixtureRequest, stack: tuple[Server, StackCredentials], tmp_path: Path, run_id: str
) -> AsyncIterator[Rig]:
    """The scheduler's side (SandboxedAgents, as the scheduler) and a tool-sandbox service running
    `agent.py:<param>`, each on its own identity; an endpoint; a port open on this host's loopback
    and a file beside the job's, for the agent to try."""
    listener = socket.create_server(("127.0.0.1", 0))
    secret = tmp_path / "secret.txt"
    secret.write_text("not for agents")
    task = tmp_path / "task"
    task.mkdir()
    (task / "agent.py").write_text(AGENT.format(port=listener.getsockname()[1], secret=str(secret)))
    (task / "command_agent.py").write_text(COMMAND)
    endpoint = Endpoint()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", endpoint.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    endpoint.base_url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    secure_nats, creds = stack
    sandbox_bus = await Bus.connect(
        secure_nats.url, run_id, "tool-sandbox", "tool-sandbox-0", creds.nats_auth("tool-sandbox")
    )
    scheduler_bus = await Bus.connect(
        secure_nats.url, run_id, "scheduler", "scheduler-0", creds.nats_auth("scheduler")
    )
    executor = SandboxExecutor(SandboxSettings())
    await executor.start()
    command = request.param.get("command") if isinstance(request.param, dict) else None
    job = AgentJob(None if command else f"agent:{request.param}", [str(task)], command)
    sandboxes = AgentSandboxes(SandboxSettings(), job, None)
    await sandboxes.start()
    await ToolSandboxService(sandbox_bus, executor, sandboxes).start()
    agents = SandboxedAgents(scheduler_bus, timeout_s=60)
    await agents.start()
    try:
        yield Rig(endpoint, agents, sandboxes, listener.getsockname()[1], secret)
    finally:
        await agents.close()
        await sandboxes.close()
        await scheduler_bus.close()
        await sandbox_bus.close()
        await executor.close()
        await runner.cleanup()
        listener.close()


@pytest.mark.parametrize("rig", ["agent"], indirect=True)
async def test_the_agent_reaches_its_endpoint_and_nothing_else(rig: Rig) -> None:
    outcomes = await asyncio.gather(
        *(
            rig.agents.run(f"t{i}", {"q": f"question {i}"}, rig.endpoint.base_url, f"key-{i}")
            for i in range(2)
        )
    )
    assert outcomes == [0.5, 0.5], outcomes
    by_key: dict[str, list[dict[str, Any]]] = {}
    for key, body in rig.endpoint.calls:
        by_key.setdefault(key, []).append(body)
    assert sorted(by_key) == ["key-0", "key-1"]  # each run with its own trajectory's key
    for i in range(2):
        first, second = by_key[f"key-{i}"]
        assert first["messages"][0]["content"] == f"question {i}"  # the dataset row it was given
        seen = json.loads(second["messages"][0]["content"])
        assert seen == {
            "reply": f"hi key-{i}",  # the endpoint's answer came back through relay and bridge
            "host": "sandbox",
            "host_port": "unreachable",  # no network of this host's
            "secret": False,  # nothing of this host's files but the job's own code
            "libra_env": [],  # no service settings, no credentials
            "code": "read-only",
        }, seen
    assert not rig.sandboxes.running and not rig.sandboxes.asked  # every sandbox reaped


@pytest.mark.parametrize("rig", ["hang"], indirect=True)
async def test_a_hung_agent_times_out_and_a_cancelled_one_ends(rig: Rig) -> None:
    rig.agents.timeout_s = 2.0
    hung = await rig.agents.run("slow", {}, rig.endpoint.base_url, "k")
    assert isinstance(hung, PluginFailure) and hung.code == "agent_timeout", hung
    rig.agents.timeout_s = 60.0
    run = asyncio.create_task(rig.agents.run("doomed", {}, rig.endpoint.base_url, "k"))
    for _ in range(100):  # until its sandbox runs
        if "doomed" in rig.sandboxes.running:
            break
        await asyncio.sleep(0.05)
    rig.agents.cancel("doomed")
    cancelled = await asyncio.wait_for(run, 10)
    assert isinstance(cancelled, PluginFailure) and cancelled.code == "agent_cancelled"
    for _ in range(100):  # the sandbox heard the cancel and killed the run
        if not rig.sandboxes.asked:
            break
        await asyncio.sleep(0.05)
    assert not rig.sandboxes.asked and not rig.sandboxes.running


@pytest.mark.parametrize("rig", ["broken"], indirect=True)
async def test_bad_runs_are_typed_failures_and_the_sandbox_keeps_serving(rig: Rig) -> None:
    invalid = await rig.agents.run("t", {}, rig.endpoint.base_url, "k")
    assert isinstance(invalid, PluginFailure) and invalid.code == "agent_invalid", invalid
    # an endpoint beyond loopback in the clear: refused before anything runs
    refused = await rig.agents.run("t2", {}, "http://198.51.100.7:8000/v1", "k")
    assert isinstance(refused, PluginFailure) and refused.code == "agent_crashed"
    assert "refused" in refused.message and "https" in refused.message
    rig.sandboxes.job = AgentJob("no_such_module:agent", [])
    missing = await rig.agents.run("t3", {}, rig.endpoint.base_url, "k")
    assert isinstance(missing, PluginFailure) and missing.code == "agent_crashed"
    assert "cannot be loaded" in missing.message and "no_such_module" in missing.message
    assert not rig.endpoint.calls


PYTHON = Path(SandboxSettings().agent_python)


@pytest.mark.skipif(not str(PYTHON).startswith("/usr/"), reason="no interpreter of this version under /usr")
@pytest.mark.parametrize("rig", [{"command": [PYTHON.name, "command_agent.py"]}], indirect=True)
async def test_an_agent_command_runs_in_the_sandbox_as_it_would_beside_the_scheduler(rig: Rig) -> None:
    """`task.agent_command` in the sandbox: the program reads the endpoint and key from the
    environment, the row from stdin, runs in the (read-only) plugin path, and its last line is
    the reward; a command that fails is `agent_error` with its exit code."""
    assert await rig.agents.run("t", {"q": "hello"}, rig.endpoint.base_url, "key-c") == 0.25
    ((key, body),) = rig.endpoint.calls
    assert key == "key-c" and body["messages"][0]["content"] == "hello /opt/libra/task/0"
    rig.sandboxes.job = AgentJob(
        None, rig.sandboxes.job.plugin_paths, [PYTHON.name, "-c", "raise SystemExit(3)"]
    )
    failed = await rig.agents.run("t2", {}, rig.endpoint.base_url, "k")
    assert isinstance(failed, PluginFailure) and failed.code == "agent_error" and "exited 3" in failed.message
    rig.sandboxes.job = AgentJob(None, [], ["no-such-program"])
    missing = await rig.agents.run("t3", {}, rig.endpoint.base_url, "k")
    assert (
        isinstance(missing, PluginFailure)
        and missing.code == "agent_crashed"
        and "could not start" in missing.message
    )


async def test_with_no_sandbox_a_run_fails_once_its_patience_is_out(
    stack: tuple[Server, StackCredentials], run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sandboxed_agents, "ACCEPT_PATIENCE_S", 1.0)
    secure_nats, creds = stack
    bus = await Bus.connect(secure_nats.url, run_id, "scheduler", "scheduler-0", creds.nats_auth("scheduler"))
    agents = SandboxedAgents(bus, timeout_s=60)
    try:
        await agents.start()
        out = await asyncio.wait_for(agents.run("t", {}, "http://127.0.0.1:1/v1", "k"), 30)
        assert isinstance(out, PluginFailure) and out.code == "agent_crashed"
        assert "tool-sandbox service" in out.message and not agents.runs
    finally:
        await bus.close()
