"""Agent environments: what answers the model between its turns (`task.environment`).

An environment is a class whose constructor takes `task.environment_args` as keyword arguments (none
by default); the scheduler makes one instance per trajectory and calls:

- `reset(sample) -> prompt`: `sample` is the task's row (a dict; the built-in tasks' has `prompt_id`,
  `question`, `answer`). Return the prompt as a string (one user message) or chat messages
  (`[{"role": ..., "content": ...}, ...]`, rendered with the model's chat template), or None to use
  the dataset's prompt. Every member of a GRPO group gets the same sample: derive any randomness
  from it, so that the group's rewards compare like with like.
- `step(response) -> Step` (or a dict with the same keys): the model's turn as text. Return
  `done=True` to end the episode (with a `reward`, or None to let `task.reward` score it), an
  `observation` the model sees next, and/or a `tool_call` (`{"name": ..., "arguments": {...}}`)
  that the tool sandbox runs in its isolation; the tool's result follows the observation.
- `tool_result(tool, status, output)` (optional): the result of the tool it asked for.
- `close()` (optional): the trajectory ended (its episode done or cut short): free what it holds.

`task.max_turns` and `task.max_context_tokens` still bound every episode; one cut short is scored by
`task.reward` if set, else gets 0. User environments run in `task.env_workers` processes, never on
the scheduler's event loop; a call that raises, hangs past `task.env_timeout_s` or kills its process
fails only its trajectory (`env_error`, `env_timeout`, `env_crashed`; a return value of the wrong
kind: `env_invalid`), which is then not trained on.

The built-in tasks' environment is `ToolUse`: the model calls tools and ends with an answer.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.scheduler.agent import ToolRequest, parse_action
from services.scheduler.plugins import PluginFailure, PluginLoadError, PluginProcess

Prompt = str | list[dict[str, str]] | None
_STEP_KEYS = {"observation", "done", "reward", "tool_call"}


@dataclass(frozen=True)
class Step:
    observation: str = ""
    """Text the model sees next (rendered as the user's turn)."""
    done: bool = False
    """The episode is over."""
    reward: float | None = None
    """With done: the trajectory's reward (None: `task.reward` scores it, else 0)."""
    tool_call: dict[str, Any] | None = field(default=None)
    """A tool for the sandbox to run: {"name": TOOL, "arguments": {...}}."""

    @property
    def tool(self) -> ToolRequest | None:
        if self.tool_call is None:
            return None
        return ToolRequest(self.tool_call["name"], dict(self.tool_call.get("arguments", {})))

    def as_json(self) -> dict[str, Any]:
        return {
            "observation": self.observation,
            "done": self.done,
            "reward": self.reward,
            "tool_call": self.tool_call,
        }


class Environment(Protocol):
    def reset(self, sample: dict[str, Any]) -> Prompt: ...

    def step(self, response: str) -> Step | dict[str, Any]: ...


def step_of(value: Any) -> Step:
    """A `step()` return value as a checked Step; ValueError says what is wrong with it."""
    if isinstance(value, Step):
        value = value.as_json()
    if not isinstance(value, dict):
        raise ValueError(f"returned {type(value).__name__}, not a Step or a dict")
    unknown = set(value) - _STEP_KEYS
    if unknown:
        raise ValueError(f"returned unknown keys {sorted(unknown)}; known: {sorted(_STEP_KEYS)}")
    obs, done, reward, call = (value.get(k) for k in ("observation", "done", "reward", "tool_call"))
    obs = "" if obs is None else obs
    if not isinstance(obs, str):
        raise ValueError(f"observation is {type(obs).__name__}, not a string")
    if not isinstance(done or False, bool):
        raise ValueError(f"done is {type(done).__name__}, not a bool")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise ValueError(f"reward {reward!r} is not a finite number")
        reward = float(reward)
    if call is not None and not (
        isinstance(call, dict)
        and isinstance(call.get("name"), str)
        and isinstance(call.get("arguments", {}), dict)
        and set(call) <= {"name", "arguments"}
    ):
        raise ValueError('tool_call must be {"name": TOOL, "arguments": {...}}')
    if not done and not obs and call is None:
        raise ValueError("neither ended the episode, nor gave an observation or a tool_call")
    return Step(obs, bool(done), reward, call)


def prompt_of(value: Any) -> Prompt:
    """A `reset()` return value as a checked prompt; ValueError says what is wrong with it."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        for m in value:
            if not (
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                and set(m) == {"role", "content"}
            ):
                raise ValueError('returned a list that is not chat messages [{"role": .., "content": ..}]')
        return value
    raise ValueError(f"returned {type(value).__name__}: a prompt is a string, chat messages or None")


class ToolUse:
    """The built-in tasks' environment: each turn either calls a tool (`<calc>`, a ```python block,
    or a Hermes `<tool_call>`) whose result the model sees next, or ends the episode with its
    answer (the task's own reward scores it)."""

    def reset(self, sample: dict[str, Any]) -> Prompt:
        return None

    def step(self, response: str) -> Step:
        request = parse_action(response)
        return Step(done=True) if request is None else Step(tool_call=request.as_call())


class EnvPool:
    """`task.env_workers` processes holding user environments, one instance per trajectory. A
    trajectory stays on one process (its instance lives there); calls to one process are answered
    in order. A process killed for a timeout loses its other trajectories' instances too: their next
    call fails `env_error` (no environment), and those trajectories are replaced like any failure."""

    def __init__(
        self,
        ref: str,
        plugin_paths: list[str],
        workers: int,
        timeout_s: float,
        args: dict[str, Any] | None = None,
    ):
        """`args`: each instance's constructor's keyword arguments (task.environment_args)."""
        self.timeout_s, self.args = timeout_s, dict(args or {})
        self.workers = [
            PluginProcess("env", ref, list(plugin_paths), "task.environment") for _ in range(workers)
        ]
        self.locks = [asyncio.Lock() for _ in self.workers]

    async def start(self) -> None:
        """Starts every process; raises PluginLoadError when the class cannot be loaded."""
        for w in self.workers:
            await w.start()

    async def _call(self, trajectory_id: str, request: dict[str, Any]) -> Any | PluginFailure:
        i = zlib.crc32(trajectory_id.encode()) % len(self.workers)
        async with self.locks[i]:
            return await self.workers[i].call({**request, "id": trajectory_id}, self.timeout_s)

    async def reset(self, trajectory_id: str, sample: dict[str, Any]) -> Prompt | PluginFailure:
        out = await self._call(trajectory_id, {"op": "reset", "sample": sample, "args": self.args})
        return out if isinstance(out, PluginFailure) else prompt_of(out)

    async def step(self, trajectory_id: str, response: str) -> Step | PluginFailure:
        out = await self._call(trajectory_id, {"op": "step", "response": response})
        return out if isinstance(out, PluginFailure) else step_of(out)

    async def tool_result(
        self, trajectory_id: str, tool: str, status: str, output: str
    ) -> PluginFailure | None:
        out = await self._call(
            trajectory_id, {"op": "tool_result", "tool": tool, "status": status, "output": output}
        )
        return out if isinstance(out, PluginFailure) else None

    async def forget(self, trajectory_id: str) -> None:
        """Drops the trajectory's instance (best effort: a failure here costs nothing)."""
        await self._call(trajectory_id, {"op": "close"})

    async def close(self) -> None:
        for w in self.workers:
            await w.kill()


async def check_environment(
    ref: str,
    plugin_paths: list[str],
    sample: dict[str, Any] | None = None,
    args: dict[str, Any] | None = None,
) -> None:
    """Loads the environment class once, as the scheduler will, and resets one instance (made with
    `args`) on `sample` (the dataset's first row); raises PluginLoadError if it cannot be loaded or
    that reset fails."""
    pool = EnvPool(ref, plugin_paths, 1, 60.0, args)
    try:
        await pool.start()
        if sample is None:
            return
        prompt = await pool.reset("config-check", sample)
        await pool.forget("config-check")
        if isinstance(prompt, PluginFailure):
            raise PluginLoadError(
                f"task.environment {ref!r}: reset(sample) on the dataset's first row failed "
                f"({prompt.code}): {prompt.message}"
            )
    except ValueError as err:  # reset returned something that is not a prompt
        raise PluginLoadError(f"task.environment {ref!r}: reset(sample) {err}") from None
    finally:
        await pool.close()
