"""`task.agent`: the user's own agent drives the trajectory over the OpenAI-compatible endpoint.

The agent's first call is the prompt (its messages in the model's chat template); each call after
it must repeat the conversation as Libra answered it and adds what came since (tool results, the
user's next message), rendered as the template's continuation of the sampled tokens, which are kept
as sampled: what is trained is exactly what was generated. A call that rewrites the conversation
Libra answered (cuts, summarises or edits it) is rendered whole and begins a new sequence of the
trajectory (`task.edited_history: segment`; `refuse` answers it `history_edited`): each sequence is
trained as the model saw it. The run's return value is the reward (None: `task.reward` scores it,
else 0).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from services.common.runconfig import TaskConfig
from services.common.signals import ToolSignal, size_class
from services.common.tls import TlsFiles
from services.scheduler.agents import AgentPool, CommandAgents
from services.scheduler.chat import TemplateError
from services.scheduler.chat_api import (
    ApiError,
    ChatRequest,
    returned_signal,
    streamable,
    with_choices,
)
from services.scheduler.choices import Choice, ChoiceBook, answer, repeats
from services.scheduler.endpoint import AgentEndpoint, AgentSession, Call, Ended
from services.scheduler.environment import Step
from services.scheduler.episodes import Episode, SampledTurn, Spawn
from services.scheduler.inflight import Live
from services.scheduler.plugins import PluginFailure
from services.scheduler.prompting import Prompter
from services.scheduler.sandboxed_agents import SandboxedAgents


def template_message(msg: dict[str, Any]) -> dict[str, Any]:
    """A normal-form message as chat templates take it (tool calls as OpenAI function calls with
    their arguments parsed, as Hugging Face templates expect)."""
    out: dict[str, Any] = {"role": msg["role"], "content": msg["content"]}
    if msg.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in msg["tool_calls"]
        ]
    if msg["role"] == "tool":
        out["tool_call_id"] = msg["tool_call_id"]
    return out


def _shown(prompt: str | list[int] | None) -> str:
    return prompt if isinstance(prompt, str) else f"({len(prompt or [])} token ids)"


def transcript_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(f"[{m['role']}] {m['content']}" for m in messages)


def common_prefix(a: list[Any], b: list[Any]) -> int:
    """How many first items `a` and `b` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@dataclass(frozen=True)
class Observation:
    """A trajectory's next observation, rendered while its call was checked: its tokens, what
    C-MLFQ is to see of it, and whether it is the whole conversation rewritten (a new sequence)."""

    ids: list[int]
    signal: ToolSignal
    rewritten: bool = False


class AgentEpisode(Episode):
    builtin_reward = False

    def __init__(
        self,
        prompter: Prompter,
        task: TaskConfig,
        model_source: str,
        spawn: Spawn,
        host: str,
        port: int,
        tls: TlsFiles | None = None,
        sandboxed: SandboxedAgents | None = None,
    ):
        """`sandboxed`: the tool sandboxes run the agent (`task.agent_sandbox`)."""
        super().__init__(prompter)
        self.task, self.spawn = task, spawn
        self.agents: AgentPool | CommandAgents | SandboxedAgents = sandboxed or (
            AgentPool(task.agent, task.plugin_paths, task.env_workers, task.agent_timeout_s)
            if task.agent
            else CommandAgents(task.agent_command or [], task.plugin_paths, task.agent_timeout_s)
        )
        self.endpoint = AgentEndpoint(
            host, port, model_source, task.max_context_tokens, len(prompter.tok), tls
        )
        self.sessions: dict[str, AgentSession] = {}
        self.observations: dict[str, Observation] = {}
        """Each trajectory's next observation."""
        self.choices = ChoiceBook()
        self.rewrites = 0
        """Calls that rewrote their conversation and began a new sequence."""

    async def start(self) -> None:
        await self.endpoint.start()
        await self.agents.start(self.endpoint.agent_env)

    async def close(self) -> None:
        await self.agents.close()
        await self.endpoint.close()

    async def reset(self, live: Live) -> PluginFailure | None:
        traj = live.traj
        session = self.sessions[traj.trajectory_id] = self.endpoint.open(traj.trajectory_id)
        self.spawn(self._run(live, session))
        live.deadline = math.inf  # the agent's own timeout bounds it
        while True:
            event = await self._next(live, session)
            if isinstance(event, Ended):
                return self._ended_early(event)
            request = event.request
            try:
                prompt = self._prompt(request)
            except ApiError as err:
                session.refuse(err)
                continue
            traj.set_prompt(prompt)
            session.tools, session.completions = request.tools, request.prompt is not None
            if isinstance(request.prompt, str):
                session.text = request.prompt
            live.prompt_messages = request.messages or [{"role": "prompt", "content": _shown(request.prompt)}]
            self._sample_as_asked(live, event)
            return None

    async def _next(self, live: Live, session: AgentSession) -> Call | Ended:
        """The agent's next call, or its end; the wait is its own time (its tools, its logic),
        counted as the trajectory's tool time."""
        began = time.monotonic()
        event = await session.next_event()
        live.times.tool_s += time.monotonic() - began
        return event

    async def _run(self, live: Live, session: AgentSession) -> None:
        row = live.traj.task.row()
        outcome = await self.agents.run(live.trajectory_id, row, self.endpoint.base_url, session.key)
        session.events.put_nowait(Ended(outcome))

    def _ended_early(self, event: Ended) -> PluginFailure:
        if isinstance(event.outcome, PluginFailure):
            return event.outcome
        return PluginFailure("agent_invalid", "the agent returned without calling the model")

    def _prompt(self, request: ChatRequest) -> list[int]:
        if request.prompt is not None:  # a completions call: text as the tokenizer reads it, or ids
            prompt = request.prompt
            ids = (
                list(prompt)
                if isinstance(prompt, list)
                else [int(t) for t in self.prompter.tok(prompt)["input_ids"]]
            )
            self._fits(len(ids))
            return ids
        if request.messages[-1]["role"] == "assistant":
            raise ApiError(
                400, "invalid_value", "the last message is the assistant's: nothing to answer", "messages"
            )
        try:
            ids = self.prompter.chat.render([template_message(m) for m in request.messages], request.tools)
        except TemplateError as err:
            raise ApiError(400, "template_error", str(err), "messages") from None
        self._fits(len(ids))
        return ids

    def _fits(self, context_tokens: int) -> None:
        limit = self.task.max_context_tokens
        if context_tokens + 1 > limit:
            raise ApiError(
                400,
                "context_length_exceeded",
                f"the conversation is {context_tokens} tokens; this job's contexts take at most {limit}",
                "messages",
            )

    def _sample_as_asked(self, live: Live, call: Call) -> None:
        """The call's sampling settings for its turn (the job's where it leaves one out), and its
        completion's id."""
        task, request = self.task, call.request
        call.rid = live.trajectory_id[-12:] + f"-{live.traj.turns + 1}"
        live.stream = request.stream
        live.temperature = request.temperature or task.temperature
        live.top_p = request.top_p or task.top_p
        live.stop = list(request.stop or task.stop_strings or [])
        live.seed = request.seed
        live.alternatives = request.n - 1
        live.traj.turn_budget = min(request.max_tokens or task.max_new_tokens, task.max_new_tokens)

    async def step(self, live: Live, turn: SampledTurn) -> Step | PluginFailure | None:
        session = self.sessions[live.trajectory_id]
        if session.pending is not None:
            self._answer(live, session, turn)
        live.deadline = math.inf
        while True:
            event = await self._next(live, session)
            if isinstance(event, Ended):
                if isinstance(event.outcome, PluginFailure):
                    return event.outcome
                return Step(done=True, reward=event.outcome)
            picked = self.choices.continued(live.trajectory_id, event.request)
            if picked is not None:
                self._go_on_from(live, session, picked)
            try:
                said = self._continued(live, session, event)
            except ApiError as err:
                session.refuse(err)
                continue
            self._sample_as_asked(live, event)
            return Step(observation=said)

    def progress(self, live: Live, token_ids: list[int]) -> None:
        """A streamed call's turn so far: what of its content is sure goes out (`streamable`)."""
        session = self.sessions.get(live.trajectory_id)
        call = session.pending if session is not None else None
        if call is None or not call.request.stream:
            return
        text = self.prompter.tok.decode(token_ids, skip_special_tokens=True)
        chat_tools = bool(call.request.tools) and call.request.prompt is None
        call.show(streamable(text, list(live.stop or []), chat_tools))

    def _answer(self, live: Live, session: AgentSession, turn: SampledTurn) -> None:
        """The call's completion: the turn, and its alternatives where it asked for `n` > 1 (each
        a choice the agent may go on from, `choices.py`); the session is the first choice's."""
        call = session.pending
        assert call is not None
        model, n = call.request.model or self.endpoint.model, call.request.n
        choices = [
            answer(self.prompter, model, live, call, t, session.text) for t in [turn, *turn.alternatives][:n]
        ]
        self.choices.offer(live.trajectory_id, [c for c, _ in choices])
        self._go_on_from(live, session, choices[0][0])
        session.answer(200, with_choices([body for _, body in choices]))

    def _go_on_from(self, live: Live, session: AgentSession, choice: Choice) -> None:
        """The trajectory as if its last call's answer were `choice` (the first, unless the agent
        went on from another)."""
        session.context, session.text = choice.context, choice.text
        if choice.history:
            session.history = choice.history
        self.choices.go_on_from(live.trajectory_id, choice)

    def taken(self, live: Live) -> SampledTurn | None:
        return self.choices.taken(live.trajectory_id)

    def alternatives_kept(self) -> int:
        return self.choices.kept

    def _continued(self, live: Live, session: AgentSession, call: Call) -> str:
        """What this call adds (as the samples show it), checked and rendered (`observations`);
        ApiError if it cannot be answered, or would not fit."""
        request, before = call.request, session.history
        if (request.prompt is not None) != session.completions:
            kind = "completions" if session.completions else "chat completions"
            raise ApiError(
                400, "invalid_value", f"this trajectory's calls are {kind}: one kind per trajectory"
            )
        edit = self._edit(session, request)
        if edit is not None:
            return self._rewritten(live, session, request, *edit)
        if request.prompt is not None:
            return self._prompt_continued(live, session, request.prompt)
        new = request.messages[len(before) :]
        if new and new[-1]["role"] == "assistant":
            raise ApiError(
                400, "invalid_value", "the last message is the assistant's: nothing to answer", "messages"
            )
        try:
            ids = self.prompter.chat.continuation_ids(
                [template_message(m) for m in new], self.choices.ended_with_eos(live.trajectory_id)
            )
        except TemplateError as err:
            raise ApiError(400, "template_error", str(err), "messages") from None
        self._fits(len(session.context) + len(ids))
        signal = returned_signal(new, before[-1] if before else None, len(ids))
        self.observations[live.trajectory_id] = Observation(ids, signal)
        return transcript_text(new) or "(continue)"

    def _edit(self, session: AgentSession, request: ChatRequest) -> tuple[str, str] | None:
        """Where and how the call does not continue the conversation as Libra answered it (the
        field, why), or None when it does."""
        prompt, before = request.prompt, session.history
        said = "the conversation does not repeat the one this trajectory had"
        if repeats(request, session.context, session.text, before):
            return (
                None
                if prompt is not None or request.tools == session.tools
                else ("tools", f"{said} (its tools changed)")
            )
        if isinstance(prompt, list):
            return "prompt", "the prompt's ids do not begin with this trajectory's context"
        if isinstance(prompt, str):
            return "prompt", "the prompt does not begin with this trajectory's text so far"
        at = common_prefix(request.messages, before)
        if at < len(request.messages):
            return f"messages.{at}", f"{said} (message {at} differs)"
        return "messages", f"{said} (it is shorter)"

    def _rewritten(
        self, live: Live, session: AgentSession, request: ChatRequest, param: str, why: str
    ) -> str:
        """A call that rewrote the conversation: rendered whole, the next sequence's prompt (or
        refused, as `task.edited_history` says)."""
        if self.task.edited_history == "refuse":
            raise ApiError(
                400,
                "history_edited",
                f"{why}: a trajectory's history is what was sampled (task.edited_history: refuse)",
                param,
            )
        ids = self._prompt(request)
        if request.prompt is not None:
            session.text = request.prompt if isinstance(request.prompt, str) else None
            shown = _shown(request.prompt)
            signal = ToolSignal("user", size_class(len(ids)), "success")
        else:
            before = session.history
            new = request.messages[common_prefix(request.messages, before) :]
            session.tools = request.tools
            shown = transcript_text(new)
            signal = returned_signal(new, before[-1] if before else None, len(ids))
        self.observations[live.trajectory_id] = Observation(ids, signal, rewritten=True)
        self.rewrites += 1
        return f"(conversation rewritten: a new sequence of {len(ids)} tokens)\n{shown}"

    def _prompt_continued(self, live: Live, session: AgentSession, prompt: str | list[int]) -> str:
        """A completions call after the first whose prompt begins with the trajectory so far — its
        context as token ids, or the text of the prompt and the completions returned."""
        held = len(session.context)
        if isinstance(prompt, list):
            ids, added, session.text = prompt[held:], f"({len(prompt) - held} tokens)", None
        else:
            added = prompt[len(session.text or "") :]
            ids, session.text = self.prompter.chat.ids(added), prompt
        self._fits(held + len(ids))
        self.observations[live.trajectory_id] = Observation(
            ids, ToolSignal("user", size_class(len(ids)), "success")
        )
        return transcript_text([{"role": "user", "content": added}])

    def calls_refused(self) -> dict[str, int]:
        return dict(self.endpoint.refused)

    def history_rewrites(self) -> int:
        return self.rewrites

    def reply_ids(self, live: Live, text: str) -> list[int]:
        return self.observations[live.trajectory_id].ids

    def reply_rewrites(self, live: Live) -> bool:
        return self.observations[live.trajectory_id].rewritten

    def reply_signal(self, live: Live, observation_ids: list[int]) -> ToolSignal:
        return self.observations.pop(live.trajectory_id).signal

    def forget(self, live: Live) -> None:
        self.choices.forget(live.trajectory_id)
        session = self.sessions.pop(live.trajectory_id, None)
        self.observations.pop(live.trajectory_id, None)
        if session is not None:
            self.endpoint.drop(session)
            self.agents.cancel(live.trajectory_id)
