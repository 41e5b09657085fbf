"""What answers the model between its turns, one interface for the three kinds of task: the built-in
tool-use tasks (tools run in the sandbox, the task's reward scores), a user's `task.environment`
(reset / step / tool_result in plugin processes) and the synthetic task (a simulator workload's
scripted turns, filler observations). The driver asks the episode, never which kind it is."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from services.common.runconfig import TaskConfig
from services.common.signals import ToolSignal, size_class
from services.common.tracing import tracer
from services.scheduler.agent import observation
from services.scheduler.environment import EnvPool, Step
from services.scheduler.feed import GroupTicket
from services.scheduler.inflight import Live
from services.scheduler.plugins import PluginFailure
from services.scheduler.prompting import Prompter
from services.scheduler.synthetic_task import SyntheticTask
from services.scheduler.trajectory import ScriptedTurn

Spawn = Callable[[Awaitable[None]], Any]
"""Runs a coroutine in the background (`Bus.spawn`)."""


@dataclass(frozen=True)
class SampledTurn:
    """A generation turn as it came back: its tokens as sampled, their logprobs, its text and why
    it ended (`stop` | `length`)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    versions: list[int] = field(default_factory=list)
    """The weight version that sampled each token."""
    alternatives: list[SampledTurn] = field(default_factory=list)
    """Further samples of the turn's prompt, where its call asked for them (`n` > 1)."""


@dataclass(frozen=True)
class Member:
    """One trajectory of a group as the task sets it up: its prompt and, if scripted, its turns."""

    prompt_ids: list[int]
    script: list[ScriptedTurn] | None = None


class Episode:
    """The built-in tasks: each turn calls a tool or answers; the tool's output, as text, is what
    the model sees next; the task's reward (built in, or `task.reward`) scores the answer."""

    builtin_reward = True
    """The trajectory's own reward rule scores it (False: the environment gives the reward)."""

    def __init__(self, prompter: Prompter):
        self.prompter = prompter

    async def start(self) -> None:
        """Loads what the task needs; raises if it cannot (the scheduler then does not start)."""

    async def close(self) -> None:
        pass

    def members(self, ticket: GroupTicket, version: int, size: int) -> list[Member]:
        prompt_ids = self.prompter.prompt_ids(ticket.task)
        return [Member(prompt_ids) for _ in range(size)]

    async def reset(self, live: Live) -> PluginFailure | None:
        """Before the first turn (the episode may set the prompt)."""
        return None

    async def step(self, live: Live, turn: SampledTurn) -> Step | PluginFailure | None:
        """After a turn: what the episode says (None: the trajectory's own parser decides)."""
        return None

    def progress(self, live: Live, token_ids: list[int]) -> None:
        """The turn in flight has sampled `token_ids` so far (a streamed turn: `Live.stream`)."""

    def taken(self, live: Live) -> SampledTurn | None:
        """After `step`: the sample the trajectory keeps instead of the turn (an agent that went on
        from one of its call's alternatives); None: the turn itself."""
        return None

    def reply_ids(self, live: Live, text: str) -> list[int]:
        """The tokens of the episode's reply `text` (a `Step.observation`)."""
        return self.prompter.observation_ids(text, live.traj.ended_with_eos)

    def reply_rewrites(self, live: Live) -> bool:
        """The reply (`reply_ids`) is the whole conversation, rewritten: it replaces the context
        and begins a new sequence of the trajectory."""
        return False

    def reply_signal(self, live: Live, observation_ids: list[int]) -> ToolSignal:
        """What C-MLFQ sees of the reply: a small, successful return of the environment."""
        return ToolSignal("environment", size_class(len(observation_ids)), "success")

    async def tool_observation(
        self, live: Live, status: str, payload: str, signal: ToolSignal
    ) -> list[int] | PluginFailure:
        """The tokens the model sees after its tool call returned."""
        text = observation(status, payload)
        failed = await self._tool_result(live, signal.tool, status, text)
        if failed is not None:
            return failed
        traj, pending = live.traj, live.pending_tool
        preface = pending.preface if pending else ""
        obs = self.prompter.observation_ids(f"{preface}\n{text}" if preface else text, traj.ended_with_eos)
        live.tool_log.append(
            {
                "tool": signal.tool,
                "args": json.loads(pending.request.args_json) if pending else {},
                "status": status,
                "observation": text,
            }
        )
        return obs

    async def _tool_result(self, live: Live, tool: str, status: str, text: str) -> PluginFailure | None:
        return None

    def forget(self, live: Live) -> None:
        """The trajectory ended: whatever the episode held for it goes."""

    def calls_refused(self) -> dict[str, int]:
        """A `task.agent`'s endpoint calls refused, by error code (no other episode takes calls)."""
        return {}

    def alternatives_kept(self) -> int:
        """A `task.agent`'s calls with `n` > 1 that went on from an alternative (`taken`)."""
        return 0

    def history_rewrites(self) -> int:
        """A `task.agent`'s calls that rewrote their conversation (each began a new sequence)."""
        return 0


class EnvironmentEpisode(Episode):
    """A user's `task.environment`: one instance per trajectory in `task.env_workers` processes; a
    call that fails fails only its trajectory."""

    builtin_reward = False

    def __init__(self, prompter: Prompter, task: TaskConfig, spawn: Spawn):
        super().__init__(prompter)
        assert task.environment is not None
        self.envs = EnvPool(
            task.environment, task.plugin_paths, task.env_workers, task.env_timeout_s, task.environment_args
        )
        self.spawn = spawn

    async def start(self) -> None:
        await self.envs.start()

    async def close(self) -> None:
        await self.envs.close()

    async def reset(self, live: Live) -> PluginFailure | None:
        traj = live.traj
        with tracer().start_as_current_span("env.reset", context=trace.set_span_in_context(live.span)):
            prompt = await self.envs.reset(traj.trajectory_id, traj.task.row())
        if isinstance(prompt, PluginFailure):
            return PluginFailure(prompt.code, f"reset: {prompt.message}")
        if prompt is not None:
            traj.set_prompt(self.prompter.render(prompt))
        return None

    async def step(self, live: Live, turn: SampledTurn) -> Step | PluginFailure | None:
        with tracer().start_as_current_span("env.step", context=trace.set_span_in_context(live.span)):
            answer = await self.envs.step(live.trajectory_id, turn.text)
        if isinstance(answer, PluginFailure):
            return PluginFailure(answer.code, f"turn {live.traj.turns + 1}: {answer.message}")
        return answer

    async def _tool_result(self, live: Live, tool: str, status: str, text: str) -> PluginFailure | None:
        failed = await self.envs.tool_result(live.trajectory_id, tool, status, text)
        return None if failed is None else PluginFailure(failed.code, f"tool_result: {failed.message}")

    def forget(self, live: Live) -> None:
        self.spawn(self.envs.forget(live.trajectory_id))


class SyntheticEpisode(Episode):
    """The synthetic task: each group drawn from a simulator workload, its turns scripted, its tool
    returns the workload's token counts for the size class the sandbox reports."""

    def __init__(self, prompter: Prompter, task: TaskConfig, time_scale: float):
        super().__init__(prompter)
        self.synthetic = SyntheticTask(task, time_scale)

    def members(self, ticket: GroupTicket, version: int, size: int) -> list[Member]:
        specs = self.synthetic.group(ticket, version)
        # A group's samples share their prompt: its tokens are drawn once (drawing them took 95 %
        # of launching a trajectory, ~1.4 ms for r2e_gym's prompts), each member gets its own copy.
        prompts: dict[str, list[int]] = {}
        out = []
        for spec in (specs[i] for i in range(size)):
            ids = prompts.get(spec.prompt_id)
            if ids is None:
                ids = prompts[spec.prompt_id] = self.synthetic.prompt_ids(spec)
            out.append(Member(list(ids), self.synthetic.script(spec)))
        return out

    async def tool_observation(
        self, live: Live, status: str, payload: str, signal: ToolSignal
    ) -> list[int] | PluginFailure:
        return self.synthetic.observation_ids(signal.size)
