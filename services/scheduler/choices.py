"""An agent's call with `n` > 1: the turn and the alternatives its engine sampled beside it are the
call's choices. The conversation the agent sends next says which one it went on from: that one is
the trajectory's turn, trained as sampled (its tokens, logprobs and versions), and the others are
never trained. A call that goes on from none (its history edited) keeps the first; so does an
agent that ends after the call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.scheduler.chat_api import (
    ChatRequest,
    assistant_message,
    completion_body,
    parse_tool_calls,
    text_completion_body,
    tool_names,
    without_stop,
)
from services.scheduler.endpoint import Call
from services.scheduler.episodes import SampledTurn
from services.scheduler.inflight import Live
from services.scheduler.prompting import Prompter


@dataclass(frozen=True)
class Choice:
    """One choice as the agent received it, and what the trajectory is if it goes on from it."""

    turn: SampledTurn
    ended_with_eos: bool
    """It closed itself with the model's EOS (its continuation does not close it again)."""
    context: list[int]
    """The trajectory's tokens with it: the context it was sampled from and its own."""
    history: list[dict[str, Any]]
    """A chat call's messages and this choice's reply, in normal form (a completions call: [])."""
    text: str | None = None
    """Completions with text prompts: the prompt and the completions returned, this one last."""


def repeats(
    request: ChatRequest, context: list[int], text: str | None, history: list[dict[str, Any]]
) -> bool:
    """Whether `request` begins with a trajectory as it was answered: a token-id prompt with its
    `context`, a text prompt with its `text`, a chat call's messages with its `history` (a chat
    call's tools are checked apart)."""
    prompt = request.prompt
    if isinstance(prompt, list):
        return prompt[: len(context)] == context
    if isinstance(prompt, str):
        return text is not None and prompt.startswith(text)
    return request.messages[: len(history)] == history


def continued(choices: list[Choice], request: ChatRequest) -> int | None:
    """Which choice `request` goes on from (the first it repeats), or None: none of them."""
    return next((i for i, c in enumerate(choices) if repeats(request, c.context, c.text, c.history)), None)


class ChoiceBook:
    """Each trajectory's last call's choices (one, unless it asked for `n` > 1), and the one it
    goes on from: the first, or the one its agent's next call continued."""

    def __init__(self) -> None:
        self.choices: dict[str, list[Choice]] = {}
        self.current: dict[str, Choice] = {}
        self.kept = 0
        """Calls with `n` > 1 whose agent went on from an alternative (kept instead of the turn)."""

    def offer(self, trajectory_id: str, choices: list[Choice]) -> None:
        self.choices[trajectory_id] = choices

    def continued(self, trajectory_id: str, request: ChatRequest) -> Choice | None:
        """The choice `request` goes on from (the first where it goes on from none); None before
        the trajectory's first answer."""
        choices = self.choices.get(trajectory_id)
        return choices[continued(choices, request) or 0] if choices else None

    def go_on_from(self, trajectory_id: str, choice: Choice) -> None:
        self.current[trajectory_id] = choice

    def taken(self, trajectory_id: str) -> SampledTurn | None:
        """The alternative the trajectory went on from, kept instead of its turn (counted); None:
        the turn."""
        choices, current = self.choices.get(trajectory_id), self.current.get(trajectory_id)
        if not choices or current is None or current is choices[0]:
            return None
        self.kept += 1
        return current.turn

    def ended_with_eos(self, trajectory_id: str) -> bool:
        """Whether the answer the trajectory goes on from closed itself with the model's EOS."""
        current = self.current.get(trajectory_id)
        return current is not None and current.ended_with_eos

    def forget(self, trajectory_id: str) -> None:
        self.choices.pop(trajectory_id, None)
        self.current.pop(trajectory_id, None)


def answer(
    prompter: Prompter, model: str, live: Live, call: Call, turn: SampledTurn, text: str | None
) -> tuple[Choice, dict[str, Any]]:
    """`turn` as a choice of `call`, and its completion body (`text`: a text-completions
    trajectory's text so far)."""
    request, created, rid = call.request, call.created, call.rid
    content = without_stop(turn.text, list(live.stop or []))
    usage = (live.traj.context_tokens, len(turn.token_ids))
    texts = [prompter.tok.decode([t]) for t in turn.token_ids] if request.logprobs else None
    logprobs = list(turn.logprobs) if request.logprobs else None
    context = [*live.traj.context, *turn.token_ids]  # the turn joins it after this call
    ids = (live.traj.context, list(turn.token_ids)) if request.return_token_ids else None
    eos = prompter.ended_with_eos(turn.token_ids, turn.finish_reason)
    if request.prompt is not None:
        body = text_completion_body(
            rid, model, created, content, turn.finish_reason, usage, texts, logprobs, ids
        )
        return Choice(turn, eos, context, [], None if text is None else text + content), body
    content, calls = (
        parse_tool_calls(content, live.traj.turns + 1, tool_names(request.tools))
        if request.tools
        else (content, [])
    )
    reply = assistant_message(content, calls)
    body = completion_body(rid, model, created, reply, turn.finish_reason, usage, texts, logprobs, ids)
    return Choice(turn, eos, context, [*request.messages, reply]), body
