"""What comes back between turns is rendered in the model's own chat template, and a trajectory's
tokens — prompt, sampled turns kept as sampled, continuations — spell exactly the conversation the
template would render, for three template families."""

from __future__ import annotations

from typing import Any

import pytest

from services.common.models import load_tokenizer
from services.scheduler.chat import ChatTemplate, TemplateError
from services.scheduler.prompting import Prompter
from tests.unit.chat_templates import families

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
PROMPT = [
    {"role": "system", "content": "You solve arithmetic with tools."},
    {"role": "user", "content": "What is 12 times 7?"},
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": {"expression": "12*7"}},
}


@pytest.fixture(scope="module")
def tokenizers(tiny_model: Any) -> dict[str, Any]:
    return families(load_tokenizer(tiny_model))


def _turn(family: str) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    """The assistant's message, the text the model sampled for it, and what comes back."""
    if family == "qwen-tools":
        sampled = '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'
        return (
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            sampled,
            [{"role": "tool", "tool_call_id": "call_1", "content": "84"}],
        )
    text = "<calc>12*7</calc>"
    return {"role": "assistant", "content": text}, text, [{"role": "user", "content": "Result: 84"}]


@pytest.mark.parametrize("family", ["chatml", "llama3", "qwen-tools"])
@pytest.mark.parametrize("ended_with_eos", [True, False])
def test_a_trajectory_spells_the_templates_conversation(
    tokenizers: dict[str, Any], family: str, ended_with_eos: bool
) -> None:
    tok = tokenizers[family]
    chat = ChatTemplate(tok)
    tools = TOOLS if family == "qwen-tools" else None
    assistant, sampled_text, new = _turn(family)
    sampled = chat.ids(sampled_text) + ([tok.eos_token_id] if ended_with_eos else [])
    ids = chat.render(PROMPT, tools) + sampled + chat.continuation_ids(new, ended_with_eos)
    whole = tok.apply_chat_template(
        [*PROMPT, assistant, *new], tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert tok.decode(ids, clean_up_tokenization_spaces=False) == whole


def test_a_tool_role_is_the_templates_own(tokenizers: dict[str, Any]) -> None:
    chat = ChatTemplate(tokenizers["qwen-tools"])
    results = [
        {"role": "tool", "tool_call_id": "a", "content": "84"},
        {"role": "tool", "tool_call_id": "b", "content": "5"},
    ]
    text = chat.continuation(results, ended_with_eos=True)
    assert text == (
        "\n<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\n5\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_built_in_observation_is_a_user_turn_closed_as_sampled(tokenizers: dict[str, Any]) -> None:
    """SmolLM2's ChatML: what the built-in loop showed before the template rendered it."""
    tok = tokenizers["chatml"]
    prompter = Prompter(tok)
    for eos, closing in ((True, ""), (False, "<|im_end|>")):
        expected = f"{closing}\n<|im_start|>user\nResult: 5<|im_end|>\n<|im_start|>assistant\n"
        assert (
            prompter.observation_ids("Result: 5", eos) == tok(expected, add_special_tokens=False)["input_ids"]
        )
    llama = Prompter(tokenizers["llama3"])
    text = llama.tok.decode(llama.observation_ids("Result: 5", ended_with_eos=False))
    assert text == "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nResult: 5<|eot_id|>" + (
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_a_template_that_rewrites_history_is_refused(tokenizers: dict[str, Any]) -> None:
    """Like reasoning templates that drop an earlier turn's thinking: the sampled tokens could not
    be kept, so the continuation is an error, not a silent mismatch."""
    import copy

    tok = copy.deepcopy(tokenizers["chatml"])
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}(earlier turn){% else %}{{ m.content }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TemplateError, match="renders earlier messages differently"):
        ChatTemplate(tok).continuation([{"role": "user", "content": "more"}], ended_with_eos=True)


def test_a_tokenizer_without_a_template_gets_plain_turns(tokenizers: dict[str, Any]) -> None:
    import copy

    tok = copy.deepcopy(tokenizers["chatml"])
    tok.chat_template = None
    prompter = Prompter(tok)
    assert tok.decode(prompter.render("Hi")) == "User: Hi\nAssistant:"
    assert tok.decode(prompter.observation_ids("Result: 5", True)) == "\nUser: Result: 5\nAssistant:"
    with pytest.raises(TemplateError, match="no chat template"):
        prompter.chat.continuation([{"role": "user", "content": "x"}], True)
