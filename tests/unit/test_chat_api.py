"""The endpoint's reading of a chat-completions request, field by field, and the completion it writes."""

from __future__ import annotations

from typing import Any

import pytest

from services.common.signals import ToolSignal
from services.scheduler.chat_api import (
    ApiError,
    assistant_message,
    completion_body,
    completion_chunks,
    normal_message,
    parse_completion,
    parse_request,
    parse_tool_calls,
    returned_signal,
    streamable,
    text_completion_body,
    text_completion_chunks,
    tool_names,
    with_choices,
    without_stop,
)

USER = [{"role": "user", "content": "hi"}]


def _refused(body: Any) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse_request(body, 1024)
    assert err.value.status == 400
    return err.value


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"frequency_penalty": 0.5}, "frequency_penalty", "unsupported_parameter"),
        ({"stream": "yes"}, "stream", "invalid_value"),
        ({"stream": True, "stream_options": {"chunk_size": 1}}, "stream_options", "invalid_value"),
        ({"n": 9}, "n", "invalid_value"),
        ({"n": 0}, "n", "invalid_value"),
        ({"temperature": 0}, "temperature", "invalid_value"),
        ({"temperature": 3.0}, "temperature", "invalid_value"),
        ({"temperature": "hot"}, "temperature", "invalid_value"),
        ({"top_p": 0}, "top_p", "invalid_value"),
        ({"max_tokens": True}, "max_tokens", "invalid_value"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_completion_tokens": 5000}, "max_completion_tokens", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
        ({"stop": [""]}, "stop", "invalid_value"),
        ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
        ({"tool_choice": "required"}, "tool_choice", "unsupported_parameter"),
        ({"tools": "calculator"}, "tools", "invalid_value"),
        ({"messages": []}, "messages", "invalid_value"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "invalid_value"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages.0.content",
            "invalid_value",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "invalid_value"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"x": 1}]}]},
            "messages.0.tool_calls.0",
            "invalid_value",
        ),
    ],
)
def test_what_cannot_be_honoured_names_its_field(extra: dict[str, Any], param: str, code: str) -> None:
    err = _refused({"model": "m", "messages": USER, **extra})
    assert (err.param, err.code) == (param, code)
    body = err.body()["error"]
    assert body["type"] == "invalid_request_error" and body["param"] == param and body["message"]


def test_a_body_that_is_not_an_object_is_refused() -> None:
    assert _refused([1, 2]).message == "the request body must be a JSON object"


def test_a_request_in_normal_form() -> None:
    req = parse_request(
        {
            "model": "m",
            "messages": [
                {
                    "role": "developer",
                    "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
                },
                {"role": "user", "content": "hi", "name": "ignored"},
                {
                    "role": "assistant",
                    "content": None,
                    "refusal": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
            ],
            "stop": "END",
            "seed": -1,
            "max_tokens": 7,
            "temperature": 0.7,
            "logprobs": True,
        },
        1024,
    )
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "name": "f", "arguments": {"a": 1}}],
        },
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ]
    assert (req.stop, req.max_tokens, req.temperature, req.logprobs) == (["END"], 7, 0.7, True)
    assert req.seed == (1 << 64) - 1  # a negative seed as the engine's unsigned one


def test_tool_calls_in_the_hermes_format() -> None:
    text = (
        'Let me add.<tool_call>{"name": "calc", "arguments": {"x": "1+1"}}</tool_call>'
        '<tool_call>{"name": "calc", "arguments": {"x": "2"}}</tool_call><tool_call>not json</tool_call>'
    )
    content, calls = parse_tool_calls(text, 3)
    assert content == "Let me add.<tool_call>not json</tool_call>"
    assert calls == [
        {"id": "call_3_0", "name": "calc", "arguments": {"x": "1+1"}},
        {"id": "call_3_1", "name": "calc", "arguments": {"x": "2"}},
    ]
    assert parse_tool_calls("no calls here ", 1) == ("no calls here ", [])


def test_a_completion_as_the_openai_client_reads_it() -> None:
    reply = assistant_message("", [{"id": "call_1_0", "name": "calc", "arguments": {"x": 1}}])
    body = completion_body("t-1", "m", 1, reply, "stop", (10, 2), ["a", "b"], [-0.5, -0.25], ([1, 2], [3, 4]))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"x": 1}'}
    assert [c["logprob"] for c in choice["logprobs"]["content"]] == [-0.5, -0.25]
    assert (body["prompt_token_ids"], choice["token_ids"]) == ([1, 2], [3, 4])
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    plain = completion_body("t-2", "m", 1, assistant_message("hi", []), "length", (1, 1), None, None, None)
    assert plain["choices"][0]["finish_reason"] == "length" and plain["choices"][0]["logprobs"] is None
    assert "prompt_token_ids" not in plain


def test_a_call_with_n_gets_n_choices_and_the_usage_of_all() -> None:
    assert parse_request({"messages": USER, "n": 3}, 1024).n == 3
    assert parse_request({"messages": USER}, 1024).n == 1
    assert parse_completion({"prompt": "hi", "n": 2}, 1024, 100).n == 2
    bodies = [
        completion_body("t-1", "m", 1, assistant_message(text, []), finish, (10, k), None, None, None)
        for text, finish, k in (("a", "stop", 2), ("b", "length", 5), ("c", "stop", 1))
    ]
    body = with_choices(bodies)
    assert body["id"] == bodies[0]["id"] and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["a", "b", "c"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length", "stop"]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18}
    assert with_choices(bodies[:1]) is bodies[0]


def test_the_stop_string_is_left_out_of_the_content() -> None:
    assert without_stop("x = 1</code>", ["</answer>", "</code>"]) == "x = 1"
    assert without_stop("x = 1", ["</code>"]) == "x = 1"


def test_a_message_out_of_order_is_named() -> None:
    with pytest.raises(ApiError, match="a message is an object") as err:
        normal_message("hi", 4)
    assert err.value.param == "messages.4"


def test_a_streamed_completion_adds_up_to_the_whole_one() -> None:
    reply = assistant_message("Let me add.", [{"id": "call_1_0", "name": "calc", "arguments": {"x": 1}}])
    body = completion_body(
        "t-1", "m", 1, reply, "stop", (10, 3), ["a", "b", "c"], [-0.1, -0.2, -0.3], ([1], [2, 3, 4])
    )
    chunks = completion_chunks(body, include_usage=True)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and {c["id"] for c in chunks} == {
        body["id"]
    }
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content", "") for d in deltas) == "Let me add."
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["function"] == {"name": "calc", "arguments": '{"x": 1}'}
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish == [None, None, None, "tool_calls"]
    assert chunks[-2]["choices"][0]["token_ids"] == [2, 3, 4] and chunks[-2]["prompt_token_ids"] == [1]
    assert chunks[-1] == {
        **{k: chunks[0][k] for k in ("id", "created", "model", "object")},
        "choices": [],
        "usage": body["usage"],
    }
    logprobs = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [t["logprob"] for lp in logprobs for t in lp["content"]] == [-0.1, -0.2, -0.3]
    assert len(completion_chunks(body, include_usage=False)) == len(chunks) - 1


def test_a_streamed_completion_of_n_choices_adds_up_to_each() -> None:
    """n = 2 streamed: each choice's chunks carry its index and add up to it (the first's after
    what went out while its turn generated); the usage once, at the end."""
    bodies = [
        completion_body("t-1", "m", 1, assistant_message(text, []), "stop", (4, 2), None, None, None)
        for text in ("Let me add.", "It is 5.")
    ]
    body = with_choices(bodies)
    for sent in (None, "Let me"):
        chunks = completion_chunks(body, include_usage=True, sent=sent)
        by_index: dict[int, str] = {}
        for c in chunks[:-1]:
            (choice,) = c["choices"]
            by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["delta"].get("content", "")
        assert by_index == {0: "Let me add."[len(sent or "") :], 1: "It is 5."}
        assert chunks[-1]["usage"]["completion_tokens"] == 4 and not chunks[-1]["choices"]
    texts = [text_completion_body("t-2", "m", 1, t, "stop", (4, 2), None, None, None) for t in ("ab", "cd")]
    chunks = text_completion_chunks(with_choices(texts), False, "a")
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks] == [
        (0, "b"),
        (0, ""),
        (1, "cd"),
        (1, ""),
    ]


def test_what_an_agents_next_call_tells_cmlfq() -> None:
    reply = assistant_message(
        "", [{"id": "c1", "name": "search", "arguments": {}}, {"id": "c2", "name": "python", "arguments": {}}]
    )

    def tool(call_id: str, content: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call_id, "content": content}

    assert returned_signal([tool("c1", "3 results")], reply, 40) == ToolSignal("search", "small", "success")
    assert (
        returned_signal([tool("c2", "Traceback (most recent call last): ...")], reply, 600).key
        == "python|medium|failure"
    )
    assert returned_signal([tool("c2", "ValueError: bad input")], reply, 10).status == "failure"
    assert returned_signal([tool("c1", "ok"), tool("c2", "the call timed out")], reply, 10) == ToolSignal(
        "search", "small", "timeout"
    )
    assert returned_signal([tool("zz", "fine")], reply, 10).tool == "tool"  # answers no call it made
    assert returned_signal([{"role": "user", "content": "next"}], reply, 5000) == ToolSignal(
        "user", "large", "success"
    )
    assert returned_signal([tool("c1", "no errors found")], reply, 10).status == "success"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 99]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "logprobs": 5}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "messages": USER}, "messages"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
    ],
)
def test_a_completions_request_names_what_it_cannot_honour(body: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_completion({"model": "m", **body}, 1024, vocab_size=50)
    assert err.value.param == param


def test_a_completions_request_and_its_answer() -> None:
    req = parse_completion({"model": "m", "prompt": ["Once"], "logprobs": 0, "stop": "."}, 1024, 50)
    assert (req.prompt, req.logprobs, req.stop, req.messages) == ("Once", True, ["."], [])
    assert parse_completion({"prompt": [[3, 4]]}, 1024, 50).prompt == [3, 4]
    body = text_completion_body(
        "x", "m", 1, "ab", "stop", (2, 2), ["a", "b"], [-0.5, -0.25], ([3, 4], [5, 6])
    )
    lp = body["choices"][0]["logprobs"]
    assert (lp["tokens"], lp["token_logprobs"], lp["text_offset"]) == (["a", "b"], [-0.5, -0.25], [0, 1])
    assert (body["object"], body["prompt_token_ids"], body["choices"][0]["token_ids"]) == (
        "text_completion",
        [3, 4],
        [5, 6],
    )
    chunks = text_completion_chunks(body, include_usage=True)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "ab"
    assert chunks[0]["prompt_token_ids"] == [3, 4] and chunks[-1]["usage"] == body["usage"]


def test_a_turn_that_is_one_json_call_of_an_offered_tool_is_a_tool_call() -> None:
    """Llama 3.1's JSON tool calls (`parameters`), with or without its python tag."""
    offered = tool_names([{"type": "function", "function": {"name": "calc"}}, {"name": "search"}])
    assert offered == ["calc", "search"]
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "calc", "parameters": {"x": "1+1"}}', 2, offered
    )
    assert (content, calls) == ("", [{"id": "call_2_0", "name": "calc", "arguments": {"x": "1+1"}}])
    assert (
        parse_tool_calls('{"name": "search", "arguments": {"q": "a"}}', 1, offered)[1][0]["name"] == "search"
    )
    for text in (
        '{"name": "rm", "parameters": {}}',
        '{"answer": 4}',
        "{not json}",
        'I call {"name": "calc"}',
    ):
        assert parse_tool_calls(text, 1, offered) == (text, []), text  # not a call of an offered tool


def _content(text: str, stops: list[str], tools: bool) -> str:
    """The content a turn's whole text gets when it ends (as the agent episode makes it)."""
    content = without_stop(text, stops)
    return parse_tool_calls(content, 1, ["calc"])[0] if tools else content


@pytest.mark.parametrize(
    ("text", "stops", "tools"),
    [
        ("The answer is 42.", [], False),
        ("The answer is 42.</answer>", ["</answer>"], False),
        ('Let me add. <tool_call>{"name": "calc", "arguments": {}}</tool_call>', [], True),
        ('Let me add.  \n<tool_call>{"name": "calc", "arguments": {}}</tool_call> done', ["END"], True),
        ("<tool_call>not json</tool_call> and text", [], True),
        ('{"name": "calc", "parameters": {"x": 1}}', [], True),
        ('{"name": "other"} is not a call', [], True),
        (' leading space, then <tool_call>{"name": "calc"}</tool_call>', [], True),
        ("caf\u00e9 \ufffd", [], False),
        ("a <tool b <tool_ c", ["<tool"], True),
    ],
)
def test_what_streams_as_a_turn_generates_begins_its_final_content(
    text: str, stops: list[str], tools: bool
) -> None:
    """At every point of a turn, what may go out is a prefix of the content the whole turn gets,
    and it only grows."""
    final = _content(text, stops, tools)
    sent = ""
    for end in range(len(text) + 1):
        shown = streamable(text[:end], stops, tools)
        assert final.startswith(shown), (text[:end], shown, final)
        if len(shown) > len(sent):
            assert shown.startswith(sent)
            sent = shown


def test_plain_text_streams_whole_and_only_a_possible_stop_waits() -> None:
    assert streamable("The answer is 4", [], False) == "The answer is 4"
    assert streamable("The answer is 4</ans", ["</answer>"], False) == "The answer is 4"
    assert streamable("The answer is 4</answer>", ["</answer>"], False) == "The answer is 4"
    assert streamable("Let me add. <tool_", [], True) == "Let me add."
    assert streamable("Let me add. <tool_", [], False) == "Let me add. <tool_"
    assert streamable('{"name": "ca', [], True) == "" and streamable("caf\ufffd", [], False) == "caf"


def test_a_stream_that_went_out_as_it_generated_ends_with_the_rest() -> None:
    reply = assistant_message("Let me add.", [{"id": "call_1_0", "name": "calc", "arguments": {"x": 1}}])
    body = completion_body("t-1", "m", 1, reply, "stop", (10, 3), ["a", "b", "c"], [-0.1, -0.2, -0.3], None)
    chunks = completion_chunks(body, include_usage=False, sent="Let me")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "role" not in deltas[0] and deltas[0]["content"] == " add."
    assert [t["logprob"] for t in chunks[0]["choices"][0]["logprobs"]["content"]] == [-0.1, -0.2, -0.3]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "tool_calls"]
    text = text_completion_body("x", "m", 1, "ab", "stop", (2, 2), None, None, None)
    assert [c["choices"][0]["text"] for c in text_completion_chunks(text, False, "a")] == ["b", ""]
