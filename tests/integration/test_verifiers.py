"""A verifiers (0.4) taskset, written against verifiers' own API and left unchanged, runs its
rollouts over Libra's OpenAI-compatible endpoint: verifiers' own `null` chat harness as a program
of its own, the task's calculator served by its MCP toolset, the reward from the task's own
`@vf.reward`. The model's side is played here by answering the endpoint's calls (a tool call, then
an answer). Bad input fails typed: a taskset that is not there, a harness that would run model code
on the host, a taskset combined with what it replaces."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from services.common.config import ConfigFileError
from services.common.runconfig import VERIFIERS_AGENT, RunConfig, load_run_config
from services.scheduler.agents import AgentPool
from services.scheduler.chat_api import assistant_message, completion_body
from services.scheduler.endpoint import AgentEndpoint, AgentSession, Call
from services.scheduler.feed import task_list
from services.scheduler.plugins import PluginFailure
from services.scheduler.task import Task
from services.scheduler.verifiers_env import main as list_main
from tools.runner import check_installed

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = str(ROOT / "examples" / "verifiers")


def _reply(request_id: str, reply: dict[str, Any]) -> dict[str, Any]:
    finish = "tool_calls" if reply.get("tool_calls") else "stop"
    return completion_body(request_id, "m", 0, reply, finish, (10, 5), None, None, None)


async def _play(session: AgentSession, answer: str) -> list[Call]:
    """The model's side: the first call asks the task's calculator, the second answers `answer`."""
    first = await session.next_event()
    assert isinstance(first, Call)
    (tool,) = [t["function"]["name"] for t in first.request.tools or []]
    question = first.request.messages[-1]["content"]
    a, b = (int(x) for x in re.findall(r"\d+", question))
    call = {"id": "call-1", "name": tool, "arguments": {"expression": f"{a}+{b}"}}
    session.answer(200, _reply("1", assistant_message("", [call])))
    second = await session.next_event()
    assert isinstance(second, Call)
    session.answer(200, _reply("2", assistant_message(f"The answer is \\boxed{{{answer}}}.", [])))
    return [first, second]


async def test_a_verifiers_taskset_runs_unchanged_and_scores_itself(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)  # listed from any directory: its config's paths are absolute by then
    cfg = load_run_config(ROOT / "configs" / "verifiers_example.yaml")
    tasks = task_list(cfg.task)  # the shipped example's taskset, as the scheduler lists it
    assert [t.prompt_id for t in tasks] == [f"vf-arithmetic_taskset-{i}" for i in range(64)]
    assert tasks[0].messages == ({"role": "user", "content": tasks[0].question},)
    endpoint = AgentEndpoint("127.0.0.1", 0, "tiny", max_context_tokens=4096)
    await endpoint.start()
    pool = AgentPool(VERIFIERS_AGENT, [EXAMPLE], workers=1, timeout_s=120)
    await pool.start()
    try:

        async def trajectory(task: Task, answer: str) -> tuple[Any, list[Call]]:
            session = endpoint.open(task.prompt_id)
            run = asyncio.create_task(pool.run(task.prompt_id, task.row(), endpoint.base_url, session.key))
            play = asyncio.create_task(_play(session, answer))
            await asyncio.wait([run, play], timeout=60, return_when=asyncio.FIRST_COMPLETED)
            assert play.done(), f"the rollout ended before the model answered twice: {run.result()}"
            return await asyncio.wait_for(run, 60), play.result()

        # two rollouts at once in one agent process, each with its own harness and tool server
        played = await asyncio.gather(trajectory(tasks[0], tasks[0].answer), trajectory(tasks[1], "-1"))
        (right, calls), (wrong, _) = played
        assert (right, wrong) == (1.0, 0.0)  # the task's own reward: the boxed answer is the reference
        tool_result = calls[1].request.messages[-1]
        assert tool_result["role"] == "tool" and tool_result["content"].strip() == tasks[0].answer
        assert calls[1].request.messages[:-1] == [*calls[0].request.messages, calls[1].request.messages[-2]]
        # a task the scheduler did not list is refused, not run
        bad = tasks[2].row() | {"verifiers": tasks[2].row()["verifiers"] | {"key": "0" * 16}}
        session = endpoint.open("bad")
        failed = await pool.run("bad", bad, endpoint.base_url, session.key)
        assert isinstance(failed, PluginFailure) and failed.code == "agent_error"
        assert "load() must give the same tasks" in failed.message
    finally:
        await pool.close()
        await endpoint.close()


def test_a_taskset_that_cannot_run_here_is_a_clear_error_at_start(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the scheduler's listing process answers (`verifiers_tasks` runs it as a subprocess and
    raises its last line, as the test above goes through)."""
    monkeypatch.syspath_prepend(EXAMPLE)
    assert list_main(["list", "no_such_taskset", "{}", "null", "0"]) == 1
    assert "taskset 'no_such_taskset' not found" in capsys.readouterr().err
    assert list_main(["list", "arithmetic_taskset", "{}", "bash", "0"]) == 1
    assert "harness 'bash' runs model-written code" in capsys.readouterr().err
    assert list_main(["list", "arithmetic_taskset", '{"size": 2}', "null", "1"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1  # task.dataset.size: the first tasks


def test_a_verifiers_task_runs_its_own_harness_and_rewards() -> None:
    task = {"dataset": {"verifiers": "arithmetic_taskset"}, "plugin_paths": [EXAMPLE]}
    cfg = RunConfig.model_validate({"task": task})
    assert cfg.task.agent == VERIFIERS_AGENT and cfg.task.runs_agent
    for extra in ({"reward": "numeric"}, {"agent": "mine:agent"}, {"agent_command": ["python", "a.py"]}):
        with pytest.raises(ValueError, match="task.dataset.verifiers"):
            RunConfig.model_validate({"task": task | extra})
    assert json.loads(cfg.model_dump_json())["task"]["dataset"]["harness"] == "null"


def test_verifiers_missing_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "verifiers" else real(name, *a)
    )
    task = {"dataset": {"verifiers": "arithmetic_taskset"}}
    cfg = RunConfig.model_validate({"model": {"source": "tiny-random"}, "task": task})
    with pytest.raises(ConfigFileError) as err:
        check_installed(cfg)
    assert "task.dataset.verifiers needs verifiers 0.4" in err.value.message
