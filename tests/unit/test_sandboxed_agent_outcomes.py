"""How a sandboxed agent run's end becomes its trajectory's outcome, on either side: what the
sandbox makes of what its sandbox left, and what the scheduler believes of a return."""

from __future__ import annotations

import pytest

from services.common.contracts import ev
from services.common.runconfig import RunConfig
from services.scheduler.plugins import PluginFailure
from services.scheduler.sandboxed_agents import returned
from services.tool_sandbox.agents import EndpointBridge, agent_return
from services.tool_sandbox.isolation import ProcessResult
from services.tool_sandbox.outcome import EXIT_MEMORY_LIMIT


def _result(stdout: bytes = b"", exit_code: int = 0, **kw: object) -> ProcessResult:
    base: dict[str, object] = dict(
        exit_code=exit_code,
        stdout=stdout,
        stderr=b"Traceback: boom",
        timed_out=False,
        output_exceeded=False,
        wall_s=1.0,
        cpu_s=0.5,
        peak_rss_bytes=1 << 20,
    )
    return ProcessResult(**{**base, **kw})  # type: ignore[arg-type]


def test_the_sandbox_passes_on_the_agents_answer_or_says_why_there_is_none() -> None:
    ok = agent_return("t", _result(b'{"id": "t", "ok": 0.5}\n'), 60)
    assert ok.answer_json == '{"id": "t", "ok": 0.5}' and not ok.failure and ok.cpu_s == 0.5
    assert agent_return("t", _result(timed_out=True, exit_code=-9), 60).failure == "agent_timeout"
    assert agent_return("t", _result(output_exceeded=True), 60).failure == "agent_error"
    oom = agent_return("t", _result(exit_code=EXIT_MEMORY_LIMIT), 60)
    assert oom.failure == "agent_crashed" and "memory limit" in oom.message
    died = agent_return("t", _result(b"half an answer", exit_code=1), 60)
    assert died.failure == "agent_crashed" and "boom" in died.message and not died.answer_json


def test_the_scheduler_believes_a_return_only_as_far_as_it_is_well_formed() -> None:
    assert returned(ev.AgentReturn(answer_json='{"ok": 0.25}')) == 0.25
    assert returned(ev.AgentReturn(answer_json='{"ok": null}')) is None  # task.reward scores it
    for answer, code in [
        ('{"ok": "NaN"}', "agent_invalid"),
        ('{"ok": true}', "agent_invalid"),
        ('{"error": "ValueError: x"}', "agent_error"),
        ("[1]", "agent_crashed"),
        ("not json", "agent_crashed"),
    ]:
        out = returned(ev.AgentReturn(answer_json=answer))
        assert isinstance(out, PluginFailure) and out.code == code, (answer, out)
    command = '{{"command": {{"code": {}, "stdout": "thinking\\n{}\\n", "stderr": "oops"}}}}'
    assert returned(ev.AgentReturn(answer_json=command.format(0, 0.75))) == 0.75  # its last line
    assert returned(ev.AgentReturn(answer_json=command.format(0, "null"))) is None
    failed = returned(ev.AgentReturn(answer_json=command.format(3, 1)))
    assert (
        isinstance(failed, PluginFailure)
        and failed.code == "agent_error"
        and "exited 3: oops" in failed.message
    )
    odd = returned(ev.AgentReturn(failure="rm -rf", message="x"))
    assert isinstance(odd, PluginFailure) and odd.code == "agent_crashed"  # no kinds of its own


@pytest.mark.parametrize(
    "url",
    [
        "ftp://127.0.0.1/v1",
        "http://10.0.0.3:8000/v1",
        "http://scheduler:8000/v1",
        "https://:1/v1",
        "http://127.0.0.1:99999/v1",
    ],
)
def test_the_bridge_goes_only_to_loopback_in_the_clear_else_over_https(url: str) -> None:
    with pytest.raises(Exception, match="base_url"):
        EndpointBridge(url, None)


def test_the_bridge_takes_loopback_and_https_endpoints() -> None:
    assert EndpointBridge("http://127.0.0.1:8000/v1", None).ssl is None
    bridge = EndpointBridge("https://scheduler:8443/v1", None)
    assert (bridge.host, bridge.port) == ("scheduler", 8443) and bridge.ssl is not None


def test_agent_sandbox_needs_an_agent_function() -> None:
    with pytest.raises(ValueError, match="agent_sandbox runs task.agent or task.agent_command"):
        RunConfig.model_validate({"task": {"agent_sandbox": True}})
    for agent in ({"agent": "my:agent"}, {"agent_command": ["./agent"]}):
        assert RunConfig.model_validate({"task": {**agent, "agent_sandbox": True}}).task.agent_sandbox
