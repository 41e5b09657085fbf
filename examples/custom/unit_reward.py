"""The reward of examples/custom: your own function, loaded by `task.reward: unit_reward:score` from
`task.plugin_paths: [examples/custom]`. It gets the final text, the dataset row and the trajectory
(its turns and tool calls) and returns a score (a float, or a dict with `score`)."""

from __future__ import annotations

import re
from typing import Any

_ANSWER = re.compile(r"<answer>\s*(-?[\d,]+(?:\.\d+)?)\s*</answer>")


def score(response: str, sample: dict[str, Any], trajectory: dict[str, Any]) -> dict[str, Any]:
    match = _ANSWER.search(response)
    got = float(match.group(1).replace(",", "")) if match else None
    correct = got is not None and abs(got - float(sample["answer"])) < 1e-6
    used_tool = any(call["status"] == "ok" for call in trajectory["tool_calls"])
    # 1 for the right number; a small format term for a well-formed <answer> tag
    return {"score": (1.0 if correct else 0.0) + (0.05 if match else 0.0), "used_tool": used_tool}
