"""An agent's call that does not continue the conversation Libra answered: a new sequence, rendered
whole from the call's messages (task.edited_history: segment), or a typed refusal that changes
nothing (refuse); a call that does continue it adds only what is new."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from services.common.models import load_tokenizer
from services.common.runconfig import ModelConfig, RunConfig
from services.scheduler.agent_episode import AgentEpisode, template_message
from services.scheduler.chat_api import ApiError, ChatRequest
from services.scheduler.endpoint import AgentSession, Call
from services.scheduler.episodes import SampledTurn
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


def _sampled(ep: AgentEpisode, text: str, closed: bool = False) -> SampledTurn:
    """A turn of `text` as sampled (closed with the model's EOS: `closed`)."""
    ids = ep.prompter.tok.encode(text, add_special_tokens=False) + ([ep.prompter.eos_id] if closed else [])
    return SampledTurn(ids, [-0.5] * len(ids), text, "stop", [0] * len(ids))


async def _step(ep: AgentEpisode, live: Live, turn: SampledTurn, n: int, then: list[dict[str, Any]]) -> Any:
    """The trajectory's first call (`n` choices) answered with `turn`, the agent's next call
    sending `then`: what the step says, and the first call's completion."""
    loop = asyncio.get_running_loop()
    session = ep.sessions[live.trajectory_id] = AgentSession(live.trajectory_id, "key")
    session.pending = first = Call(ChatRequest(messages=ASKED, n=n), loop.create_future())
    session.events.put_nowait(Call(ChatRequest(messages=then), loop.create_future()))
    step = await ep.step(live, turn)
    return step, first.answer.result()[1]


async def test_the_choice_an_agent_goes_on_from_is_the_turn_kept(tiny_model: ModelConfig) -> None:
    """A call with n = 3 gets the turn and its two alternatives; the agent's next call goes on
    from the third: that one is the trajectory's turn (its tokens as sampled), and its
    continuation does not close it again (it closed itself with the model's EOS)."""
    ep = episode(tiny_model, "segment")
    live, _ = answered(ep)
    turn = SampledTurn(
        **{**vars(_sampled(ep, "A.")), "alternatives": [_sampled(ep, "B."), _sampled(ep, "C.", True)]}
    )
    picked = {"role": "assistant", "content": "C."}
    step, body = await _step(ep, live, turn, 3, [*ASKED, picked, GO_ON])
    assert [c["message"]["content"] for c in body["choices"]] == ["A.", "B.", "C."]
    assert body["usage"]["completion_tokens"] == sum(len(t.token_ids) for t in [turn, *turn.alternatives])
    assert ep.taken(live) is turn.alternatives[1] and not ep.reply_rewrites(live)
    assert ep.reply_ids(live, step.observation) == ep.prompter.chat.continuation_ids([GO_ON], True)

    # going on from the first keeps the turn; going on from none (an edit) keeps it too
    for then in ([*ASKED, {"role": "assistant", "content": "A."}, GO_ON], [*ASKED, picked, REPLY, GO_ON][1:]):
        live, _ = answered(ep)
        await _step(ep, live, turn, 3, then)
        assert ep.taken(live) is None
    assert ep.alternatives_kept() == 1  # counted for the report


async def test_a_turn_that_closed_itself_is_not_closed_again(tiny_model: ModelConfig) -> None:
    """A turn that ended with the model's EOS: the conversation goes on after it without a second
    end-of-turn marker (the observation's tokens are the template's continuation of a closed
    turn); one cut by its stop string is closed by the continuation."""
    ep = episode(tiny_model, "segment")
    for closed in (True, False):
        live, _ = answered(ep)
        step, _ = await _step(
            ep,
            live,
            _sampled(ep, "Done.", closed),
            1,
            [*ASKED, {"role": "assistant", "content": "Done."}, GO_ON],
        )
        assert ep.reply_ids(live, step.observation) == ep.prompter.chat.continuation_ids([GO_ON], closed)
