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


def continued(choices: list[Choice], request: ChatRequest) -> int | None:
    """Which choice `request` goes on from (the first that matches, as `AgentEpisode._edit` reads
    a continuation), or None: it goes on from none of them."""
    for i, c in enumerate(choices):
        prompt = request.prompt
        if isinstance(prompt, list):
            ok = prompt[: len(c.context)] == c.context
        elif isinstance(prompt, str):
            ok = c.text is not None and prompt.startswith(c.text)
        else:
            ok = request.messages[: len(c.history)] == c.history
        if ok:
            return i
    return None


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
