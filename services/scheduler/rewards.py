"""Rewards by config (`task.reward`): built-in matchers, or your own `module:function` run in worker
processes so that a reward which raises, hangs or crashes fails only its trajectory.

A user reward is called as `fn(response=..., sample=..., trajectory=...)` and returns a number or a
dict with a `score`. It runs in `task.reward_workers` processes (`python -m
services.scheduler.plugin_worker reward`), never on the scheduler's event loop; one that has not answered
after `task.reward_timeout_s` is killed and replaced, and its trajectory fails with
`reward_timeout` (an exception: `reward_error`; a dead worker: `reward_crashed`). A failed
trajectory is never trained on; its group is replaced like any other failed group.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import uuid
from typing import Any

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.logging import get_logger
from services.common.runconfig import OWN_DATASETS, ReasoningGymDataset, TaskConfig
from services.scheduler.agent import PYTHON_BLOCK
from services.scheduler.plugins import PluginFailure, PluginLoadError, PluginProcess
from services.scheduler.task import extract_answer
from services.scheduler.tool_calls import ToolCalls

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
SANDBOX_GRACE_S = 10.0
"""How long past the code's own timeout a sandbox's answer is waited for."""


def overlong_penalty(tokens: int, limit: int, length: int, factor: float) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to limit - length generated
    tokens, then falling linearly to -factor at the limit, -factor beyond it."""
    start = limit - length
    if tokens <= start:
        return 0.0
    return -factor * min(1.0, (tokens - start) / length)


def exact_match(response: str, answer: Any) -> float:
    """1 when the last `<answer>` tag (or, without one, the whole stripped text) equals the reference."""
    tags = _ANSWER_TAG.findall(response)
    got = (tags[-1] if tags else response).strip()
    return float(got == str(answer).strip())


def numeric(response: str, answer: Any) -> float:
    """1 when the `<answer>` tag (or the last number) equals the reference as a number."""
    try:
        want = float(str(answer).replace(",", ""))
    except ValueError:
        return exact_match(response, answer)
    got = extract_answer(response)
    return float(got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-6))


BUILTIN = {"exact_match": exact_match, "numeric": numeric}
WORKER_REWARDS = {
    "reasoning_gym": "services.scheduler.gym_tasks:reasoning_gym_score",
    "math_verify": "services.scheduler.gym_tasks:math_verify_score",
}
"""Built-in rewards that run in reward workers, like a user's (the `environments` extra's):
name -> `module:function`, called with the reference `answer` too."""


def reward_ref(task: TaskConfig) -> str | None:
    """The reward a task is scored with outside `Trajectory` (None: the built-in task's own score)."""
    if task.reward or task.environment or task.runs_agent:  # an environment or agent rewards its own
        return task.reward
    if isinstance(task.dataset, ReasoningGymDataset):
        return "reasoning_gym"
    return "numeric" if isinstance(task.dataset, OWN_DATASETS) else None


def code_block(response: str) -> str | None:
    """The last ```python block of a response (an unclosed last block counts)."""
    blocks = [b.strip() for b in PYTHON_BLOCK.findall(response)]
    return blocks[-1] if blocks and blocks[-1] else None


def tests_of(sample: dict[str, Any]) -> str | PluginFailure:
    tests = sample.get("tests")
    if isinstance(tests, list) and all(isinstance(t, str) for t in tests):
        tests = "\n".join(tests)
    if not isinstance(tests, str) or not tests.strip():
        return PluginFailure(
            "reward_error", "code_tests needs a `tests` field (code, or a list of lines) in the row"
        )
    return tests


class SandboxClient:
    """Runs reward code in the tool sandbox over the bus: a python tool call whose return the
    scheduler's `ToolCalls` hands to the future it awaits instead of to a trajectory."""

    def __init__(self, bus: Bus, calls: ToolCalls):
        self.bus, self.calls = bus, calls

    async def run_python(self, code: str, timeout_s: float) -> ev.ToolReturn | None:
        """The sandbox's return, or None when no sandbox answered in time."""
        call_id = f"reward-{uuid.uuid4().hex}"
        fut: asyncio.Future[ev.ToolReturn] = asyncio.get_running_loop().create_future()
        self.calls.expect(call_id, fut)
        call = ev.ToolCall(
            call_id=call_id, tool="python", args_json=json.dumps({"code": code}), timeout_s=timeout_s
        )
        try:
            await self.bus.publish(subjects.TOOL_CALL, call)
            return await asyncio.wait_for(fut, timeout_s + SANDBOX_GRACE_S)
        except TimeoutError:
            return None
        finally:
            self.calls.forget(call_id)


async def code_tests(
    response: str, sample: dict[str, Any], sandbox: SandboxClient, timeout_s: float
) -> float | PluginFailure:
    """1 when the response's code passes the row's tests in the sandbox, 0 when it fails them (or
    has no code); a sandbox that refuses or never answers is a failure, not a 0."""
    tests = tests_of(sample)
    if isinstance(tests, PluginFailure):
        return tests
    code = code_block(response)
    if code is None:
        return 0.0
    ret = await sandbox.run_python(f"{code}\n\n{tests}\n", timeout_s)
    if ret is None:
        return PluginFailure("reward_timeout", "no tool sandbox answered the code_tests call")
    if ret.status == "rejected":
        return PluginFailure("reward_error", f"the sandbox refused the code_tests call: {ret.error}"[:500])
    return float(ret.status == "ok" and ret.exit_code == 0)


class RewardPool:
    """`task.reward_workers` processes running a `module:function` reward, each call bounded by
    `task.reward_timeout_s`; a killed or dead worker is replaced before its next call."""

    def __init__(self, ref: str, plugin_paths: list[str], workers: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.idle: asyncio.Queue[PluginProcess] = asyncio.Queue()
        self.workers = [
            PluginProcess("reward", ref, list(plugin_paths), "task.reward") for _ in range(workers)
        ]
        self.log = get_logger(component="rewards")

    async def start(self) -> None:
        """Starts every worker; raises PluginLoadError when the function cannot be loaded."""
        for w in self.workers:
            await w.start()
            self.idle.put_nowait(w)

    async def score(self, **kwargs: Any) -> float | PluginFailure:
        w = await self.idle.get()
        try:
            result = await w.call(kwargs, self.timeout_s)
        finally:
            self.idle.put_nowait(w)
        if isinstance(result, PluginFailure):
            if not w.alive:
                self.log.warning("reward_worker_replaced", code=result.code, reason=result.message)
            return result
        return float(result)

    async def close(self) -> None:
        """Kills every worker, busy ones too (a call in flight then fails as crashed)."""
        for w in self.workers:
            await w.kill()


class Scorer:
    """The reward of a finished trajectory under `task.reward`: built-ins inline, the rest through a
    RewardPool."""

    def __init__(self, task: TaskConfig, ref: str, sandbox: SandboxClient | None = None):
        self.ref, self.sandbox, self.timeout_s = ref, sandbox, task.reward_timeout_s
        self.builtin = BUILTIN.get(ref)
        self.pool = (
            None
            if self.builtin or ref == "code_tests"
            else RewardPool(
                WORKER_REWARDS.get(ref, ref), task.plugin_paths, task.reward_workers, task.reward_timeout_s
            )
        )

    async def start(self) -> None:
        if self.pool is not None:
            await self.pool.start()

    async def score(
        self, response: str, answer: Any, sample: dict[str, Any], trajectory: dict[str, Any]
    ) -> float | PluginFailure:
        if self.builtin is not None:
            return self.builtin(response, answer)
        if self.ref == "code_tests":
            assert self.sandbox is not None, "code_tests needs the scheduler's sandbox client"
            return await code_tests(response, sample, self.sandbox, self.timeout_s)
        assert self.pool is not None
        extra = {"answer": answer} if self.ref in WORKER_REWARDS else {}  # a user's takes the three
        return await self.pool.score(response=response, sample=sample, trajectory=trajectory, **extra)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()


def reward_trajectory(
    turns: list[str], tool_calls: list[dict[str, Any]], observations: list[str], finish: str, prompt_id: str
) -> dict[str, Any]:
    """The `trajectory` a `task.reward` function is called with (docs/tasks.md): one shape for the
    scheduler's calls and the config check's trial call."""
    return {
        "turns": turns,
        "tool_calls": tool_calls,
        "observations": observations,
        "finish": finish,
        "prompt_id": prompt_id,
    }


async def check_reward(task: TaskConfig, sample: dict[str, Any] | None = None, answer: Any = None) -> None:
    """Loads the configured reward once, as the scheduler will, and calls it on `sample` (the
    dataset's first row) with a plausible response (its reference `answer`, read under the
    dataset's `answer_key`), as the scheduler calls it; raises PluginLoadError if it cannot be
    loaded or that call fails (a wrong signature, say)."""
    ref = reward_ref(task)
    if ref is None or ref in BUILTIN or ref == "code_tests":
        return
    pool = RewardPool(WORKER_REWARDS.get(ref, ref), task.plugin_paths, 1, task.reward_timeout_s)
    try:
        await pool.start()
        if sample is None:
            return
        response = str(answer if answer is not None else sample.get("answer", ""))
        trajectory = reward_trajectory([response], [], [], "answer", str(sample.get("prompt_id", "")))
        extra = {"answer": answer} if ref in WORKER_REWARDS else {}
        result = await pool.score(response=response, sample=sample, trajectory=trajectory, **extra)
        if isinstance(result, PluginFailure):
            raise PluginLoadError(
                f"task.reward {ref!r} failed when called as the scheduler calls it, "
                f"score(response=..., sample=..., trajectory=...), on the dataset's first row "
                f"({result.code}): {result.message}"
            )
    finally:
        await pool.close()
