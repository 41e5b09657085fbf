"""A trajectory's text, as it happened, for the job's samples: what each turn generated, each tool
call with its arguments, status and what came back (a rejection with its reason), each reply of an
environment. Bounded: each text is cut to TEXT_LIMIT characters and the whole to SAMPLE_LIMIT bytes
(the latest events dropped first, and counted), so a sample never outgrows a NATS message."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

TEXT_LIMIT = 2000
"""Characters kept of one text (a turn, an argument, an observation)."""
SAMPLE_LIMIT = 64 << 10
"""Bytes of one sample's JSON at most."""


def cut(text: str, limit: int = TEXT_LIMIT) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"…[{len(text) - limit} more characters]"


def _cut_value(value: Any) -> Any:
    """A tool call's arguments with every string cut (structure kept)."""
    if isinstance(value, str):
        return cut(value)
    if isinstance(value, dict):
        return {str(k): _cut_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cut_value(v) for v in value]
    return value


@dataclass
class Transcript:
    events: list[dict[str, Any]] = field(default_factory=list)

    def assistant(self, text: str, tokens: int, versions: list[int], finish: str) -> None:
        self.events.append(
            {
                "role": "assistant",
                "text": cut(text),
                "tokens": tokens,
                "policy_versions": sorted(set(versions)),
                "finish": finish,
            }
        )

    def tool(self, tool: str, args: Any, status: str, returned: str) -> None:
        """A tool call and what came back: the tool's result, its error, or why it was refused."""
        self.events.append(
            {
                "role": "tool",
                "tool": tool,
                "args": _cut_value(args),
                "status": status,
                "returned": cut(returned),
            }
        )

    def environment(self, text: str) -> None:
        self.events.append({"role": "environment", "text": cut(text)})

    def to_json(self, head: dict[str, Any]) -> str:
        """`head` (prompt, reward, finish, ...) and the events, in at most SAMPLE_LIMIT bytes."""
        events = list(self.events)
        while True:
            dropped = len(self.events) - len(events)
            body = {**head, "events": events, **({"events_dropped": dropped} if dropped else {})}
            out = json.dumps(body, ensure_ascii=False, default=str)
            if len(out.encode()) <= SAMPLE_LIMIT or not events:
                return out
            events = events[: max(0, len(events) - max(1, len(events) // 4))]


def prompt_of(messages: Sequence[Mapping[str, Any]] | None, question: str) -> list[dict[str, str]]:
    """The prompt as the sample shows it: the task's own messages, else its question (the built-in
    datasets' system prompt and worked examples are the same for every sample, and left out)."""
    if messages:
        return [{"role": str(m.get("role", "")), "content": cut(str(m.get("content", "")))} for m in messages]
    return [{"role": "user", "content": cut(question)}]
