"""Turns model output into the agent's next action: a tool call, or the end of the trajectory."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from typing import Any

_CALC = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.S)
PYTHON_BLOCK = re.compile(r"```(?:python|py)\s*\n(.*?)(?:```|$)", re.S)
"""A ```python block (an unclosed last one too: the token budget may cut it)."""
_ANSWER = re.compile(r"<answer>.*?</answer>", re.S)
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

STOP_STRINGS = ["</calc>", "</answer>", "</tool_call>"]
MAX_OBSERVATION_CHARS = 400


@dataclass(frozen=True)
class ToolRequest:
    tool: str
    args: dict[str, Any]

    @property
    def args_json(self) -> str:
        return json.dumps(self.args)

    def as_call(self) -> dict[str, Any]:
        """As an environment's `tool_call`."""
        return {"name": self.tool, "arguments": self.args}


def parse_action(text: str) -> ToolRequest | None:
    """A tool request found in a generated turn, or None when the turn is a final answer."""
    if _ANSWER.search(text):
        return None
    call = _TOOL_CALL.search(text)
    if call:  # the Hermes / Qwen format: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
        return _tool_call(call.group(1))
    calc = _CALC.search(text)
    python = PYTHON_BLOCK.search(text)
    if calc and (not python or calc.start() < python.start()):
        expr = calc.group(1).strip()
        return ToolRequest("calculator", {"expression": expr}) if expr else None
    if python:
        code = python.group(1).strip()
        return ToolRequest("python", {"code": code}) if code else None
    return None


def _tool_call(body: str) -> ToolRequest:
    """A malformed call still becomes a request, to a tool named "" that the sandbox rejects with
    a message the model sees, rather than ending the trajectory as if it had answered."""
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return ToolRequest("", {"error": f"the tool call is not valid JSON: {e.msg}"})
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return ToolRequest("", {"error": 'a tool call is {"name": TOOL, "arguments": {...}}'})
    args = data.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        with contextlib.suppress(json.JSONDecodeError):
            args = json.loads(args)
    return ToolRequest(data["name"], args if isinstance(args, dict) else {"arguments": args})


def observation(status: str, payload: str) -> str:
    """The text the model sees after a tool call."""
    text = payload
    try:
        data = json.loads(payload)
        if isinstance(data, dict):
            text = str(data.get("result", data.get("stdout", ""))) or str(data.get("stderr", ""))
    except (json.JSONDecodeError, TypeError):
        pass
    text = text.strip()[:MAX_OBSERVATION_CHARS]
    return f"Result: {text}" if status == "ok" else f"Tool {status}: {text}"
