"""The OpenAI chat-completions protocol as Libra's agent endpoint speaks it: a request checked field by
field (what it cannot honour is a 4xx naming the field), messages in one normal form so that a
conversation sent back can be matched against the one Libra answered, tool calls parsed from the
model's text, and the completion's JSON. Pure: no I/O."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from services.common.contracts import MAX_ALTERNATIVES
from services.common.signals import ToolSignal, size_class

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
MAX_CHOICES = MAX_ALTERNATIVES + 1
"""The most choices (`n`) a call may ask for: its turn and the alternatives an engine samples
beside it."""
_SUPPORTED = {
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "n",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "logprobs",
    "top_logprobs",
    "user",
    "return_token_ids",
}
"""Fields a request may carry (`return_token_ids`: vLLM's, the sampled token ids in the choice)."""
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class ApiError(Exception):
    """A request the endpoint refuses: an OpenAI-style error body with this HTTP status."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, code, message, param)


@dataclass(frozen=True)
class ChatRequest:
    """A chat-completions call, or a (text) completions call (`prompt` set, no messages)."""

    messages: list[dict[str, Any]]
    """As sent, in normal form (`normal_message`)."""
    prompt: str | list[int] | None = None
    """A completions call's prompt: text, or token ids."""
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    return_token_ids: bool = False
    model: str = ""
    stream: bool = False
    """Server-sent events: the completion as chunks (sent once the turn is done)."""
    include_usage: bool = False
    """With stream: a last chunk with the usage."""
    n: int = 1
    """Choices to sample (the turn and n - 1 alternatives); the conversation the agent continues
    says which one the trajectory keeps."""


def _number(
    body: dict[str, Any], name: str, low: float, high: float, *, low_open: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(f"{name} must be a number", name)
    if value < low or value > high or (low_open and value == low):
        side = f"> {low:g}" if low_open else f">= {low:g}"
        raise bad(f"{name} must be {side} and <= {high:g}, got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer", name)
    if not low <= value <= high:
        raise bad(f"{name} must be between {low} and {high}, got {value}", name)
    return value


def _text(content: Any, param: str) -> str:
    """A message's content as text: a string, None, or text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise bad("only text content parts are supported", param)
            out.append(part["text"])
        return "".join(out)
    raise bad("content must be a string, null or a list of text parts", param)


def _tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise bad("tool_calls must be a list", param)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise bad("a tool call is {id, type: function, function: {name, arguments}}", f"{param}.{i}")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = args
        out.append({"id": str(call.get("id", "")), "name": fn["name"], "arguments": parsed})
    return out


def normal_message(msg: Any, i: int) -> dict[str, Any]:
    """A message as the endpoint compares and renders it: role, text content, and the tool calls
    (name and parsed arguments) or the tool call it answers."""
    param = f"messages.{i}"
    if not isinstance(msg, dict):
        raise bad("a message is an object with a role", param)
    role = msg.get("role")
    if role not in ROLES:
        raise bad(f"role must be one of {', '.join(ROLES)}, got {role!r}", f"{param}.role")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    out["content"] = _text(msg.get("content"), f"{param}.content")
    if role == "assistant":
        calls = _tool_calls(msg.get("tool_calls"), f"{param}.tool_calls")
        if calls:
            out["tool_calls"] = calls
    if role == "tool":
        out["tool_call_id"] = str(msg.get("tool_call_id", ""))
    return out


def _common(body: Any, supported: set[str], max_context_tokens: int) -> dict[str, Any]:
    """What chat and text completions share: the fields, n, streaming and sampling."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    unknown = sorted(set(body) - supported)
    if unknown:
        raise bad(f"unsupported field {unknown[0]!r}", unknown[0], "unsupported_parameter")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not (isinstance(options, dict) and set(options) <= {"include_usage"}):
        raise bad("stream_options takes include_usage only", "stream_options")
    n = _integer(body, "n", 1, MAX_CHOICES)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not (
        isinstance(stops, list) and len(stops) <= MAX_STOP and all(isinstance(s, str) and s for s in stops)
    ):
        raise bad(f"stop must be a string or a list of at most {MAX_STOP} non-empty strings", "stop")
    budget = _integer(body, "max_completion_tokens", 1, max_context_tokens)
    if budget is None:
        budget = _integer(body, "max_tokens", 1, max_context_tokens)
    temperature = _number(body, "temperature", 0.0, 2.0)
    if temperature == 0.0:
        raise bad("temperature must be > 0: a trained turn is sampled, with its logprobs", "temperature")
    seed = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)
    model = body.get("model", "")
    return {
        "max_tokens": budget,
        "temperature": temperature,
        "top_p": _number(body, "top_p", 0.0, 1.0, low_open=True),
        "stop": stops,
        "seed": None if seed is None else seed % (1 << 64),
        "return_token_ids": bool(body.get("return_token_ids")),
        "model": model if isinstance(model, str) else "",
        "stream": stream,
        "include_usage": bool(options.get("include_usage")) and stream,
        "n": n or 1,
    }


def parse_request(body: Any, max_context_tokens: int) -> ChatRequest:
    """A chat-completions request, checked; ApiError names the first field it cannot honour."""
    common = _common(body, _SUPPORTED, max_context_tokens)
    if body.get("top_logprobs"):
        raise bad("top_logprobs is not supported: logprobs gives the sampled tokens'", "top_logprobs")
    if body.get("tool_choice", "auto") not in ("auto", None):
        raise bad("tool_choice must be 'auto'", "tool_choice", "unsupported_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    normal = [normal_message(m, i) for i, m in enumerate(messages)]
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise bad("tools must be a list of tool objects", "tools")
    return ChatRequest(messages=normal, tools=tools or None, logprobs=bool(body.get("logprobs")), **common)


_COMPLETION_FIELDS = (
    _SUPPORTED - {"messages", "tools", "tool_choice", "parallel_tool_calls", "top_logprobs"}
) | {"prompt"}


def parse_completion(body: Any, max_context_tokens: int, vocab_size: int) -> ChatRequest:
    """A (text) completions request: `prompt` is text or token ids; ApiError names the first field
    it cannot honour."""
    common = _common(body, _COMPLETION_FIELDS, max_context_tokens)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, list):
        if not prompt or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt
        ):
            raise bad(f"a token-id prompt is a non-empty list of ids below {vocab_size}", "prompt")
    elif not (isinstance(prompt, str) and prompt):
        raise bad("prompt must be a non-empty string or a list of token ids (one prompt: n is 1)", "prompt")
    logprobs = body.get("logprobs")
    if logprobs is not None and (
        isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 1
    ):
        raise bad("logprobs must be 0 or 1: the sampled tokens' (no top-k alternatives)", "logprobs")
    return ChatRequest(messages=[], prompt=prompt, logprobs=logprobs is not None, **common)


def parse_tool_calls(
    text: str, turn: int, tools: list[str] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """The content and tool calls of a generated turn: in the Hermes / Qwen format
    (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; a block that does not parse stays
    in the content), or, without such blocks, a turn that is one JSON object calling one of `tools`
    by name (Llama 3.1's JSON format: `{"name": ..., "parameters": {...}}`)."""
    bare = _bare_call(text, tools or [])
    if bare is not None:
        return "", [{"id": f"call_{turn}_0", **bare}]
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in _TOOL_CALL.finditer(text):
        try:
            data = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not (isinstance(data, dict) and isinstance(data.get("name"), str)):
            continue
        args = data.get("arguments", {})
        kept.append(text[last : m.start()])
        last = m.end()
        calls.append({"id": f"call_{turn}_{len(calls)}", "name": data["name"], "arguments": args})
    kept.append(text[last:])
    return ("".join(kept).strip() if calls else text), calls


def _bare_call(text: str, tools: list[str]) -> dict[str, Any] | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not (body.startswith("{") and body.endswith("}")):
        return None
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(data, dict) and data.get("name") in tools):
        return None
    args = data.get("parameters", data.get("arguments", {}))
    return {"name": data["name"], "arguments": args}


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """The function names a request's `tools` offer."""
    names = []
    for t in tools or []:
        fn = t["function"] if isinstance(t.get("function"), dict) else t
        if isinstance(fn.get("name"), str):
            names.append(fn["name"])
    return names


def without_stop(text: str, stops: list[str]) -> str:
    """The content without the stop string that ended it (OpenAI's convention; the trained tokens
    keep it)."""
    for s in stops:
        if text.endswith(s):
            return text[: -len(s)]
    return text


TOOL_CALL_OPEN = "<tool_call>"


def _held_back(text: str, marks: list[str]) -> str:
    """`text` cut before the first of `marks` in it, and before a tail that could begin one."""
    for mark in marks:
        if mark in text:
            text = text[: text.index(mark)]
    for k in range(min(len(text), max((len(m) for m in marks), default=0)), 0, -1):
        if any(m.startswith(text[-k:]) for m in marks):
            return text[:-k]
    return text


def streamable(text: str, stops: list[str], tools: bool) -> str:
    """What of a turn's text so far its content is sure to begin with, however the turn goes on:
    what a streamed call may send before the turn ends (`without_stop` and `parse_tool_calls`
    make the content at the end). Held back: a character not yet whole, a tail that could begin a
    stop string (the content leaves it out), and with tools a tail that could begin a
    `<tool_call>` block, trailing spaces (a turn that calls a tool has its content stripped), and
    everything while the turn could still be one bare JSON call or begins with a space."""
    text = _held_back(text.rstrip("\ufffd"), [s for s in stops if s])
    if not tools:
        return text
    if text[:1].isspace() or text.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(text):
        return ""
    return _held_back(text, [TOOL_CALL_OPEN]).rstrip()


def assistant_message(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply in normal form (what a conversation sent back must repeat)."""
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = calls
    return out


def _body(
    body_id: str,
    kind: str,
    created: int,
    model: str,
    choice: dict[str, Any],
    usage: tuple[int, int],
    token_ids: tuple[list[int], list[int]] | None,
) -> dict[str, Any]:
    """What chat and text completions share around their one choice: id, usage and, asked for,
    the context's and the turn's token ids."""
    if token_ids is not None:
        choice["token_ids"] = token_ids[1]
    prompt, completion = usage
    body = {
        "id": body_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }
    if token_ids is not None:
        body["prompt_token_ids"] = token_ids[0]
    return body


def completion_body(
    request_id: str,
    model: str,
    created: int,
    reply: dict[str, Any],
    finish: str,
    usage: tuple[int, int],
    token_texts: list[str] | None,
    logprobs: list[float] | None,
    token_ids: tuple[list[int], list[int]] | None,
) -> dict[str, Any]:
    """The chat.completion JSON: `finish` is the engine's (stop | length), tool_calls when the reply
    calls tools; `token_ids` (the context the turn was sampled from, and the turn's tokens) as vLLM's
    `prompt_token_ids` and choice `token_ids`."""
    calls = reply.get("tool_calls", [])
    message: dict[str, Any] = {"role": "assistant", "content": reply["content"] or (None if calls else "")}
    if calls:
        message["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
            }
            for c in calls
        ]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls" if calls and finish == "stop" else finish,
        "logprobs": None,
    }
    if token_texts is not None and logprobs is not None:
        choice["logprobs"] = {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(token_texts, logprobs, strict=True)
            ]
        }
    return _body(completion_id(request_id, True), "chat.completion", created, model, choice, usage, token_ids)


def with_choices(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One completion of the bodies' choices (an `n` > 1 call: each body one choice, the first's
    id, prompt and creation), its usage counting every choice's tokens."""
    body = bodies[0]
    if len(bodies) == 1:
        return body
    out = body | {"choices": [b["choices"][0] | {"index": i} for i, b in enumerate(bodies)]}
    completion = sum(b["usage"]["completion_tokens"] for b in bodies)
    prompt = body["usage"]["prompt_tokens"]
    out["usage"] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    return out


def chat_chunk(head: dict[str, Any], delta: dict[str, Any], index: int = 0, **extra: Any) -> dict[str, Any]:
    """One chat.completion.chunk of choice `index` of the completion `head` (its id, created and model)."""
    out: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None} | extra
    return {k: head[k] for k in ("id", "created", "model")} | {
        "object": "chat.completion.chunk",
        "choices": [out],
    }


def text_chunk(head: dict[str, Any], text: str) -> dict[str, Any]:
    """A piece of a streamed text completion's text."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    return {k: head[k] for k in ("id", "object", "created", "model")} | {"choices": [choice]}


def completion_id(request_id: str, chat: bool) -> str:
    """A completion's id: what its body and every chunk of its stream carry."""
    return f"chatcmpl-{request_id}" if chat else f"cmpl-{request_id}"


def streamed_content(body: dict[str, Any]) -> str:
    """A completion's content (chat) or text (completions)."""
    choice = body["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"] or "")


def completion_chunks(
    body: dict[str, Any], include_usage: bool, sent: str | None = None
) -> list[dict[str, Any]]:
    """A chat.completion as the chat.completion.chunk events a streaming client reads: for each
    choice (`index`) the role, the content (with its logprobs), the tool calls, the finish reason;
    then the usage if asked. `sent`: the role and this much of the first choice's content went out
    while the turn generated (the content begins with it); None: nothing did."""
    chunks: list[dict[str, Any]] = []
    for choice in body["choices"]:
        chunks += _choice_chunks(body, choice, sent if choice["index"] == 0 else None)
    if include_usage:
        chunks.append(chat_chunk(body, {}) | {"choices": [], "usage": body["usage"]})
    return chunks


def _choice_chunks(body: dict[str, Any], choice: dict[str, Any], sent: str | None) -> list[dict[str, Any]]:
    message, index = choice["message"], choice["index"]

    def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return chat_chunk(body, delta, index=index, **extra)

    chunks = [] if sent is not None else [chunk({"role": "assistant", "content": ""})]
    rest = (message.get("content") or "")[len(sent or "") :]
    if rest or (sent is not None and choice["logprobs"] is not None):
        chunks.append(chunk({"content": rest}, logprobs=choice["logprobs"]))
    for i, call in enumerate(message.get("tool_calls", [])):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    last = chunk({}, finish_reason=choice["finish_reason"])
    if "token_ids" in choice:
        last["choices"][0]["token_ids"] = choice["token_ids"]
    if "prompt_token_ids" in body and index == 0:
        last["prompt_token_ids"] = body["prompt_token_ids"]
    return [*chunks, last]


_TIMED_OUT = re.compile(r"timed? ?out|timeout|deadline exceeded", re.I)
_FAILED = re.compile(r"^\s*(error|traceback|exception)|(error|exception|failed):", re.I)


def returned_signal(new: list[dict[str, Any]], reply: dict[str, Any] | None, tokens: int) -> ToolSignal:
    """What an agent's next call tells C-MLFQ: its tool results (the tool named by the call they
    answer; `timeout` or `failure` where the text says so, else `success`) or, with none, the
    user's message; the size class of what the call adds."""
    results = [m for m in new if m["role"] == "tool"]
    size = size_class(tokens)
    if not results:
        return ToolSignal("user", size, "success")
    names = {c["id"]: c["name"] for c in (reply or {}).get("tool_calls", [])}
    tool = names.get(results[0].get("tool_call_id", ""), "tool")
    texts = [m["content"] for m in results]
    if any(_TIMED_OUT.search(t) for t in texts):
        return ToolSignal(tool, size, "timeout")
    if any(_FAILED.search(t) for t in texts):
        return ToolSignal(tool, size, "failure")
    return ToolSignal(tool, size, "success")


def text_completion_body(
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish: str,
    usage: tuple[int, int],
    token_texts: list[str] | None,
    logprobs: list[float] | None,
    token_ids: tuple[list[int], list[int]] | None,
) -> dict[str, Any]:
    """The text_completion JSON (the legacy completions API's logprobs layout)."""
    choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    if token_texts is not None and logprobs is not None:
        offsets = [sum(len(t) for t in token_texts[:i]) for i in range(len(token_texts))]
        choice["logprobs"] = {
            "tokens": token_texts,
            "token_logprobs": logprobs,
            "top_logprobs": None,
            "text_offset": offsets,
        }
    return _body(
        completion_id(request_id, False), "text_completion", created, model, choice, usage, token_ids
    )


def text_completion_chunks(
    body: dict[str, Any], include_usage: bool, sent: str | None = None
) -> list[dict[str, Any]]:
    """A text_completion as streamed: for each choice (`index`) its text (the first's after
    `sent`, what went out while the turn generated) in one chunk, then its finish reason; then the
    usage if asked."""
    head = {k: body[k] for k in ("id", "object", "created", "model")}
    chunks = []
    for choice in body["choices"]:
        skip = len(sent or "") if choice["index"] == 0 else 0
        text = head | {"choices": [{**choice, "text": choice["text"][skip:], "finish_reason": None}]}
        if "prompt_token_ids" in body and choice["index"] == 0:
            text["prompt_token_ids"] = body["prompt_token_ids"]
        last = {
            "index": choice["index"],
            "text": "",
            "logprobs": None,
            "finish_reason": choice["finish_reason"],
        }
        chunks += [text, head | {"choices": [last]}]
    if include_usage:
        chunks.append(head | {"choices": [], "usage": body["usage"]})
    return chunks
