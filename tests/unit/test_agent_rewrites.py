"""An agent's call that does not continue the conversation Libra answered: a new sequence, rendered
whole from the call's messages (task.edited_history: segment), or a typed refusal that changes
nothing (refuse); a call that does continue it adds only what is new."""

from __future__ import annotations

from typing import Any

import pytest

from services.common.models import load_tokenizer
from services.common.runconfig import ModelConfig, RunConfig
from services.scheduler.agent_episode import AgentEpisode, template_message
from services.scheduler.chat_api import ApiError, ChatRequest
from services.scheduler.endpoint import AgentSession, Call
from services.scheduler.inflight import Live
from services.scheduler.prompting import Prompter
from services.scheduler.task import Task
from services.scheduler.trajectory import Trajectory

ASKED = [{"role": "user", "content": "What is 2 + 3?"}]
REPLY = {"role": "assistant", "content": "Let me think."}
GO_ON = {"role": "user", "content": "Go on."}


def episode(tiny_model: ModelConfig, edited_history: str) -> AgentEpisode:
    cfg = RunConfig.model_validate(
        {
            "model": tiny_model.model_dump(),
            "task": {"agent": "m:agent", "edited_history": edited_history, "max_context_tokens": 512},
        }
    )
    return AgentEpisode(
        Prompter(load_tokenizer(tiny_model)), cfg.task, cfg.model.source, lambda _: None, "127.0.0.1", 0
    )


def answered(ep: AgentEpisode, completions: bool = False) -> tuple[Live, AgentSession]:
    """A trajectory whose first call Libra answered: its prompt, one sampled turn."""
    prompt = ep.prompter.chat.render([template_message(m) for m in ASKED])
    traj = Trajectory("t0", "g0", 0, 2, Task("p0", "q", 5), prompt, 4, 16, 512, started_at=0.0)
    session = AgentSession("t0", "key", completions=completions)
    session.history, session.context = [*ASKED, REPLY], [*prompt, 11, 12, 13]
    return Live(traj=traj, span=None, temperature=1.0), session  # type: ignore[arg-type]


def call(**kw: Any) -> Call:
    return Call(ChatRequest(**kw), None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("messages", "tools", "param"),
    [
        ([{"role": "user", "content": "What is 2 + 4?"}, REPLY, GO_ON], None, "messages.0"),  # edited
        ([*ASKED, GO_ON], None, "messages.1"),  # the reply cut out
        ([*ASKED, REPLY, GO_ON], [{"type": "function", "function": {"name": "f"}}], "tools"),
    ],
)
def test_a_rewritten_conversation_is_a_new_sequence_or_refused(
    tiny_model: ModelConfig, messages: list[dict[str, Any]], tools: Any, param: str
) -> None:
    ep = episode(tiny_model, "segment")
    live, session = answered(ep)
    said = ep._continued(live, session, call(messages=messages, tools=tools))
    fresh = ep.prompter.chat.render([template_message(m) for m in messages], tools)
    assert said.startswith(f"(conversation rewritten: a new sequence of {len(fresh)} tokens)")
    assert ep.reply_rewrites(live) and ep.reply_ids(live, said) == fresh
    assert ep.history_rewrites() == 1 and session.tools == tools

    strict = episode(tiny_model, "refuse")
    live, session = answered(strict)
    with pytest.raises(ApiError) as err:
        strict._continued(live, session, call(messages=messages, tools=tools))
    assert (err.value.status, err.value.code, err.value.param) == (400, "history_edited", param)
    assert strict.observations == {} and strict.history_rewrites() == 0 and session.tools is None


def test_a_call_that_continues_adds_only_what_is_new(tiny_model: ModelConfig) -> None:
    ep = episode(tiny_model, "segment")
    live, session = answered(ep)
    said = ep._continued(live, session, call(messages=[*ASKED, REPLY, GO_ON]))
    assert said == "[user] Go on." and not ep.reply_rewrites(live)
    assert ep.reply_ids(live, said) == ep.prompter.chat.continuation_ids([GO_ON], False)
    # token ids: the trajectory as answered (its context and the turn sampled) and one more token
    live, session = answered(ep, completions=True)
    said = ep._continued(live, session, call(messages=[], prompt=[*session.context, 7]))
    assert said == "[user] (1 tokens)" and ep.reply_ids(live, said) == [7] and not ep.reply_rewrites(live)
    cut = [*session.context[:-3], 7]  # what the model generated left out
    said = ep._continued(live, session, call(messages=[], prompt=cut))
    assert ep.reply_rewrites(live) and ep.reply_ids(live, said) == cut and ep.history_rewrites() == 1


def test_a_rewrite_that_does_not_fit_is_refused(tiny_model: ModelConfig) -> None:
    ep = episode(tiny_model, "segment")
    live, session = answered(ep, completions=True)
    with pytest.raises(ApiError) as err:
        ep._continued(live, session, call(messages=[], prompt=[7] * 600))
    assert (
        err.value.code == "context_length_exceeded" and ep.observations == {} and ep.history_rewrites() == 0
    )
