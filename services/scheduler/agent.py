"""Turns model output into the agent's next action: a tool call, or the end of the trajectory."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_CALC = re.compile(r"<calc>(.*?)(?:</calc>|$)", re.S)
_PYTHON = re.compile(r"```(?:python|py)\s*\n(.*?)(?:```|$)", re.S)
_ANSWER = re.compile(r"<answer>.*?</answer>", re.S)

STOP_STRINGS = ["</calc>", "</answer>"]
MAX_OBSERVATION_CHARS = 400


@dataclass(frozen=True)
class ToolRequest:
    tool: str
    args: dict[str, Any]

    @property
    def args_json(self) -> str:
        return json.dumps(self.args)


def parse_action(text: str) -> ToolRequest | None:
    """A tool request found in a generated turn, or None when the turn is a final answer."""
    if _ANSWER.search(text):
        return None
    calc = _CALC.search(text)
    python = _PYTHON.search(text)
    if calc and (not python or calc.start() < python.start()):
        expr = calc.group(1).strip()
        return ToolRequest("calculator", {"expression": expr}) if expr else None
    if python:
        code = python.group(1).strip()
        return ToolRequest("python", {"code": code}) if code else None
    return None


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
