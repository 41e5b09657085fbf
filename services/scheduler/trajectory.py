"""One trajectory's agent loop as an explicit state machine: generate → tool → generate … → reward.

Pure: token ids come in (already tokenised by the caller), actions go out. The caller carries them
out over the bus and feeds the results back.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from services.policy.staleness import StalenessBound
from services.scheduler.agent import ToolRequest
from services.scheduler.environment import Step, ToolUse
from services.scheduler.task import Task, score

TOOL_USE = ToolUse()
"""The built-in tasks' environment (stateless)."""


class State(enum.Enum):
    GENERATING = "generating"
    TOOL_PENDING = "tool_pending"
    REPLY_PENDING = "reply_pending"
    """The environment answered with text the caller is to tokenise (`on_reply`)."""
    DONE = "done"


class IllegalTransition(Exception):
    pass


@dataclass
class Segment:
    token_ids: list[int]
    logprobs: list[float]
    generated: bool
    policy_version: int = -1
    temperature: float = 1.0
    """Generated segments: the temperature their logprobs were computed at."""
    starts_sequence: bool = False
    """A prompt segment that replaces the context before it (an agent rewrote its conversation):
    the model sees it, not what came before, from here on."""


MAX_LOGPROB = 1e-4
"""Largest logprob taken (a probability's log is <= 0; float rounding may overshoot a little)."""


def check_turn(
    token_ids: list[int],
    logprobs: list[float],
    versions: list[int],
    temperature: float = 1.0,
    *,
    vocab_size: int | None = None,
    max_tokens: int | None = None,
) -> None:
    """Raises ValueError unless there is one logprob and one version per token, versions never
    going back (weights only move forward on an engine), the logprobs' temperature is usable,
    every logprob finite and <= 0, every token id in the vocabulary and (where given) no more
    tokens than the turn asked for. Versions newer than the trainer's are the caller's check."""
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"logprob temperature must be > 0, got {temperature}")
    if not len(token_ids) == len(logprobs) == len(versions):
        raise ValueError(
            f"{len(token_ids)} tokens, {len(logprobs)} logprobs and {len(versions)} versions differ in length"
        )
    if max_tokens is not None and len(token_ids) > max_tokens:
        raise ValueError(f"{len(token_ids)} tokens for a turn of at most {max_tokens}")
    if any(b < a for a, b in zip(versions, versions[1:], strict=False)):
        raise ValueError("token versions go back")
    if versions and versions[0] < 0:
        raise ValueError("negative token version")
    bad = next((x for x in logprobs if not (math.isfinite(x) and x <= MAX_LOGPROB)), None)
    if bad is not None:
        raise ValueError(f"logprob {bad} is not a log-probability")
    limit = vocab_size if vocab_size is not None else 1 << 31
    wrong = next((t for t in token_ids if not 0 <= t < limit), None)
    if wrong is not None:
        raise ValueError(f"token id {wrong} is outside the vocabulary ({vocab_size})")


def doomed_groups(trajs: list[Trajectory], trained_version: int, bound: StalenessBound) -> set[str]:
    """Groups the trainer can no longer take at `trained_version`: a member's oldest token is
    past the staleness bound (the trainer drops a group with any such member, and the bound only
    tightens as versions grow)."""
    return {t.group_id for t in trajs if bound.is_stale(t.oldest_version, trained_version)}


@dataclass(frozen=True)
class Generate:
    context: list[int]
    max_new_tokens: int
    min_new_tokens: int = 0


@dataclass(frozen=True)
class ScriptedTurn:
    """A synthetic trajectory's turn: exactly this many output tokens, then this tool call (None:
    the turn is the final answer)."""

    output_tokens: int
    tool: ToolRequest | None


@dataclass(frozen=True)
class CallTool:
    request: ToolRequest
    preface: str = ""
    """The environment's own observation, shown before the tool's result."""


@dataclass(frozen=True)
class Reply:
    """The environment's observation, for the caller to tokenise and hand to `on_reply`."""

    text: str


@dataclass(frozen=True)
class Finish:
    reason: str  # answer | max_turns | length | error
    reward: float
    needs_score: bool = False
    """`task.reward` is to score it (the reward here is 0 until then)."""


Action = Generate | CallTool | Reply | Finish


@dataclass
class Trajectory:
    trajectory_id: str
    group_id: str
    sample_index: int
    group_size: int
    task: Task
    prompt_ids: list[int]
    max_turns: int
    max_new_tokens: int
    max_context_tokens: int
    started_at: float
    state: State = State.GENERATING
    segments: list[Segment] = field(default_factory=list)
    turns: int = 0
    texts: list[str] = field(default_factory=list)
    tool_statuses: list[str] = field(default_factory=list)
    finish: Finish | None = None
    ended_with_eos: bool = False
    last_turn_cut: bool = False
    """The last turn ended because it reached its token budget (the engine's finish `length`)."""
    script: list[ScriptedTurn] | None = None
    """Synthetic trajectories follow a script drawn from a workload instead of parsing the text."""
    launch_version: int = 0
    """The trainer's version when its group was launched: the staleness budget admitted the group
    for that version, so no older weights may generate any of it (an engine still loading them
    waits), else the group is stale a step early and its work is thrown away."""
    tool_bonus: float = 0.1
    """Reward shaping for a successful tool call (task.tool_bonus)."""
    scored_outside: bool = False
    """Its reward comes from `task.reward` (the scheduler's Scorer), not the built-in score: a
    finished trajectory carries reward 0 until scored."""
    turn_budget: int | None = None
    """Its next turn's token budget when smaller than `max_new_tokens` (a `task.agent` call's)."""
    builtin_reward: bool = True
    """False for a user environment's task: an episode it ends without a reward, or one cut short,
    gets 0 unless `task.reward` scores it."""

    @property
    def oldest_version(self) -> int | None:
        """The policy version of its oldest generated token (None before its first token): what
        the staleness bound judges."""
        return min(self.versions) if self.versions else None

    @property
    def min_policy_version(self) -> int:
        """The oldest weights that may generate its next turn: never older than its launch version
        or than any of its tokens (weights only move forward within a trajectory)."""
        return max([self.launch_version, *self.versions])

    def __post_init__(self) -> None:
        self.segments.append(Segment(list(self.prompt_ids), [], generated=False))

    def set_prompt(self, prompt_ids: list[int]) -> None:
        """The environment's own prompt (its `reset`), before the first turn."""
        if self.turns or self.state is not State.GENERATING:
            raise IllegalTransition("the prompt is fixed once the first turn ran")
        self.prompt_ids = list(prompt_ids)
        self.segments[0] = Segment(list(prompt_ids), [], generated=False)

    @property
    def _sequence(self) -> list[Segment]:
        """The segments of its current sequence: from the last that starts one."""
        start = next((i for i in range(len(self.segments) - 1, 0, -1) if self.segments[i].starts_sequence), 0)
        return self.segments[start:]

    @property
    def context(self) -> list[int]:
        """What the model sees next: its current sequence's tokens."""
        return [t for s in self._sequence for t in s.token_ids]

    @property
    def context_tokens(self) -> int:
        """len(self.context), without building it."""
        return sum(len(s.token_ids) for s in self._sequence)

    @property
    def sequences(self) -> int:
        """Its sequences: 1, and one more each time its conversation was rewritten."""
        return 1 + sum(1 for s in self.segments[1:] if s.starts_sequence)

    @property
    def output_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.generated)

    @property
    def truncated(self) -> bool:
        """It ran out of room: its context (finish `length`) or its last turn's token budget."""
        return self.last_turn_cut or (self.finish is not None and self.finish.reason == "length")

    @property
    def versions(self) -> list[int]:
        return [s.policy_version for s in self.segments if s.generated]

    def first_action(self) -> Action:
        return self._next_generation()

    def on_turn(
        self,
        token_ids: list[int],
        logprobs: list[float],
        text: str,
        versions: list[int],
        eos: bool,
        temperature: float = 1.0,
        step: Step | None = None,
        cut: bool = False,
    ) -> Action:
        """A generation turn finished: `step` is the environment's answer to it (None: the built-in
        ToolUse, or the synthetic script) — a tool call, an observation or the end. `versions`
        names the weight version of each token; a turn that ran across a weight swap becomes one
        generated segment per version, so the trainer sees which policy sampled which token.
        `temperature` is the one the engine's logprobs were computed at; the segments carry it to
        the trainer. `cut`: the turn stopped at its token budget."""
        if self.state is not State.GENERATING:
            raise IllegalTransition(f"turn result in state {self.state.value}")
        check_turn(token_ids, logprobs, versions, temperature)
        self.turns += 1
        self.last_turn_cut = cut
        start = 0
        for end in range(1, len(token_ids) + 1):
            if end == len(token_ids) or versions[end] != versions[start]:
                self.segments.append(
                    Segment(
                        list(token_ids[start:end]),
                        list(logprobs[start:end]),
                        generated=True,
                        policy_version=versions[start],
                        temperature=temperature,
                    )
                )
                start = end
        self.texts.append(text)
        self.ended_with_eos = eos
        if step is None and self.script is not None:
            scripted = self.script[min(self.turns, len(self.script)) - 1].tool
            step = Step(done=True) if scripted is None else Step(tool_call=scripted.as_call())
        step = step if step is not None else TOOL_USE.step(text)
        if step.done:
            return self._finish("answer", step.reward)
        if self.turns >= self.max_turns:
            return self._finish("max_turns")
        request = step.tool
        if request is not None:
            self.state = State.TOOL_PENDING
            return CallTool(request, step.observation)
        self.state = State.REPLY_PENDING
        return Reply(step.observation)

    def on_tool_return(self, status: str, observation_ids: list[int]) -> Action:
        """A tool returned; its observation (tokenised by the caller) becomes part of the context."""
        if self.state is not State.TOOL_PENDING:
            raise IllegalTransition(f"tool return in state {self.state.value}")
        self.tool_statuses.append(status)
        return self._observed(observation_ids)

    def on_reply(self, observation_ids: list[int], rewritten: bool = False) -> Action:
        """The environment's observation (tokenised by the caller) becomes part of the context;
        `rewritten`: it is the whole conversation, rewritten, and replaces the context (a new
        sequence begins)."""
        if self.state is not State.REPLY_PENDING:
            raise IllegalTransition(f"environment reply in state {self.state.value}")
        return self._observed(observation_ids, rewritten)

    def _observed(self, observation_ids: list[int], rewritten: bool = False) -> Action:
        self.segments.append(Segment(list(observation_ids), [], generated=False, starts_sequence=rewritten))
        self.state = State.GENERATING
        return self._next_generation()

    def fail(self) -> Finish:
        return self._finish("error")

    def _next_generation(self) -> Action:
        ctx = self.context
        if len(ctx) + 1 > self.max_context_tokens:
            return self._finish("length")
        budget = min(self.turn_budget or self.max_new_tokens, self.max_context_tokens - len(ctx))
        if self.script is not None:
            exact = min(budget, self.script[min(self.turns, len(self.script) - 1)].output_tokens)
            return Generate(ctx, exact, exact)
        return Generate(ctx, budget)

    def _finish(self, reason: str, given: float | None = None) -> Finish:
        """`given`: the environment's own reward for the episode."""
        final_text = self.texts[-1] if self.texts else ""
        ok_tools = sum(1 for s in self.tool_statuses if s == "ok")
        needs_score = False
        if reason == "error":
            reward = 0.0
        elif given is not None:
            reward = given
        elif self.scored_outside:
            reward, needs_score = 0.0, True
        elif self.script is not None:  # synthetic: 1 when the last tool worked (or none was needed)
            reward = float(not self.tool_statuses or self.tool_statuses[-1] == "ok")
        elif not self.builtin_reward:
            reward = 0.0
        else:
            reward = score(final_text, self.task.answer, ok_tools, self.tool_bonus)
        self.finish = Finish(reason, reward, needs_score)
        self.state = State.DONE
        return self.finish
