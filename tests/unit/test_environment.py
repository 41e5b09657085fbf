"""Agent environments: the checked Step/prompt contract, the built-in ToolUse loop, a trajectory
driven by an environment's steps, and user environments in real worker processes (state per
trajectory; one that raises, hangs, returns nonsense or cannot load fails with a typed code)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from services.scheduler.environment import EnvPool, Step, ToolUse, check_environment, prompt_of, step_of
from services.scheduler.plugins import PluginFailure, PluginLoadError
from services.scheduler.task import Task
from services.scheduler.trajectory import CallTool, Finish, Generate, IllegalTransition, Reply, Trajectory

ENV = """
import time

class Game:
    def reset(self, sample):
        self.secret, self.guesses, self.tools = int(sample["answer"]), 0, []
        if sample.get("mode") == "bad_prompt":
            return 42
        return f"Guess my number ({sample['answer']} is a secret)."

    def step(self, response):
        print("noise on stdout must not break the protocol")
        if response == "raise":
            raise RuntimeError("a bug in step")
        if response == "hang":
            time.sleep(3600)
        if response == "nonsense":
            return {"done": "yes"}
        if response == "tool":
            return {"observation": "Let me check.", "tool_call": {"name": "calculator", "arguments": {"expression": "1+1"}}}
        self.guesses += 1
        if int(response) == self.secret:
            return {"done": True, "reward": 1.0 / self.guesses + 0.1 * len(self.tools)}
        return {"observation": "Higher." if int(response) < self.secret else "Lower."}

    def tool_result(self, tool, status, output):
        self.tools.append((tool, status))
"""


def test_steps_are_checked() -> None:
    assert step_of({"done": True, "reward": 1}) == Step(done=True, reward=1.0)
    assert step_of(Step(observation="hi")) == Step(observation="hi")
    call = {"name": "python", "arguments": {"code": "1"}}
    got = step_of({"tool_call": call})
    assert got.tool is not None and got.tool.tool == "python" and got.tool.args == {"code": "1"}
    for bad, why in [
        ([], "not a Step"),
        ({"obs": "x"}, "unknown keys"),
        ({"done": True, "reward": float("nan")}, "finite"),
        ({"done": True, "reward": True}, "finite"),
        ({"done": "yes"}, "bool"),
        ({"observation": 3}, "string"),
        ({"tool_call": {"tool": "python"}}, "tool_call"),
        ({}, "neither"),
    ]:
        with pytest.raises(ValueError, match=why):
            step_of(bad)


def test_prompts_are_checked() -> None:
    assert prompt_of(None) is None and prompt_of("hi") == "hi"
    msgs = [{"role": "user", "content": "hi"}]
    assert prompt_of(msgs) == msgs
    for bad in [3, [], [{"role": "user"}], [{"role": "user", "content": "x", "name": "y"}]]:
        with pytest.raises(ValueError):
            prompt_of(bad)


def test_the_builtin_tool_use_loop_is_an_environment() -> None:
    env = ToolUse()
    assert env.reset({"answer": 5}) is None
    calc = env.step("<calc>2+3</calc>")
    assert calc.tool is not None and calc.tool.tool == "calculator" and not calc.done
    assert env.step("<answer>5</answer>") == Step(done=True)


def _traj(max_turns: int = 3, **kw: Any) -> Trajectory:
    task = Task("p0", "q", 5)
    return Trajectory("t0", "g0", 0, 2, task, [1, 2], max_turns, 4, 100, started_at=0.0, **kw)


def test_a_trajectory_follows_its_environment_to_the_end() -> None:
    t = _traj(builtin_reward=False)
    t.set_prompt([7, 7, 7])
    assert isinstance(t.first_action(), Generate) and t.context == [7, 7, 7]
    reply = t.on_turn([10], [-0.1], "<guess>3</guess>", [0], eos=False, step=Step(observation="Higher."))
    assert reply == Reply("Higher.")
    with pytest.raises(IllegalTransition):
        t.on_tool_return("ok", [1])
    with pytest.raises(IllegalTransition):
        t.set_prompt([1])
    nxt = t.on_reply([20, 21])
    assert isinstance(nxt, Generate) and nxt.context == [7, 7, 7, 10, 20, 21]
    tool = t.on_turn(
        [11],
        [-0.2],
        "x",
        [0],
        eos=False,
        step=Step(observation="Checking.", tool_call={"name": "python", "arguments": {"code": "1"}}),
    )
    assert isinstance(tool, CallTool) and tool.preface == "Checking." and tool.request.tool == "python"
    t.on_tool_return("ok", [30])
    fin = t.on_turn([12], [-0.3], "y", [1], eos=True, step=Step(done=True, reward=0.75))
    assert fin == Finish("answer", 0.75)
    assert [s.generated for s in t.segments] == [False, True, False, True, False, True]


def test_an_episode_the_environment_does_not_score_gets_zero_or_the_task_reward() -> None:
    cut = _traj(builtin_reward=False, max_turns=1)
    cut.first_action()
    assert cut.on_turn([1], [-0.1], "x", [0], False, step=Step(observation="more")) == Finish(
        "max_turns", 0.0
    )
    scored = _traj(builtin_reward=False, scored_outside=True)
    scored.first_action()
    fin = scored.on_turn([1], [-0.1], "x", [0], False, step=Step(done=True))
    assert fin == Finish("answer", 0.0, needs_score=True)
    given = _traj(builtin_reward=False, scored_outside=True)
    given.first_action()
    assert given.on_turn([1], [-0.1], "x", [0], False, step=Step(done=True, reward=2.0)) == Finish(
        "answer", 2.0
    )


@pytest.fixture
def env_dir(tmp_path: Path) -> Path:
    (tmp_path / "my_env.py").write_text(ENV)
    return tmp_path


def test_user_environments_keep_state_per_trajectory_and_fail_typed(env_dir: Path) -> None:
    async def main() -> dict[str, Any]:
        pool = EnvPool("my_env:Game", [str(env_dir)], workers=1, timeout_s=2.0)
        await pool.start()
        out: dict[str, Any] = {}
        try:
            out["prompt"] = await pool.reset("a", {"answer": 7})
            await pool.reset("b", {"answer": 2})
            out["a1"] = await pool.step("a", "5")
            out["b1"] = await pool.step("b", "2")  # b's own secret: its first guess wins
            out["tool"] = await pool.step("a", "tool")
            out["tool_result"] = await pool.tool_result("a", "calculator", "ok", "Result: 2")
            out["a2"] = await pool.step("a", "7")
            out["raise"] = await pool.step("a", "raise")
            out["nonsense"] = await pool.step("a", "nonsense")
            out["bad_prompt"] = await pool.reset("c", {"answer": 1, "mode": "bad_prompt"})
            await pool.forget("a")
            out["forgotten"] = await pool.step("a", "7")
            await pool.reset("d", {"answer": 4})
            out["hang"] = await pool.step("b", "hang")
            out["lost"] = await pool.step("d", "4")  # its instance died with the killed process
            await pool.reset("e", {"answer": 9})
            out["after"] = await pool.step("e", "9")  # the pool serves on
        finally:
            await pool.close()
        return out

    out = asyncio.run(main())
    assert out["prompt"] == "Guess my number (7 is a secret)."
    assert out["a1"] == Step(observation="Higher.")
    assert out["b1"] == Step(done=True, reward=1.0)
    assert out["tool"].tool.tool == "calculator" and out["tool"].observation == "Let me check."
    assert out["tool_result"] is None
    assert out["a2"] == Step(done=True, reward=pytest.approx(0.5 + 0.1))
    codes = {k: v.code for k, v in out.items() if isinstance(v, PluginFailure)}
    assert codes == {
        "raise": "env_error",
        "nonsense": "env_invalid",
        "bad_prompt": "env_invalid",
        "forgotten": "env_error",
        "hang": "env_timeout",
        "lost": "env_error",
    }
    assert "a bug in step" in out["raise"].message and "no environment" in out["lost"].message
    assert out["after"] == Step(done=True, reward=1.0)


def test_an_environment_that_cannot_load_is_an_error_before_the_run(env_dir: Path) -> None:
    with pytest.raises(PluginLoadError, match="task.environment 'my_env:Nope'.*AttributeError"):
        asyncio.run(check_environment("my_env:Nope", [str(env_dir)]))
    asyncio.run(check_environment("my_env:Game", [str(env_dir)]))
