"""`python -m services.scheduler.reward_worker MODULE:FUNCTION [PLUGIN_PATH ...]`: one reward process.

Reads one JSON object of keyword arguments per line on stdin and answers one JSON line on its own
copy of stdout: `{"score": x}`, `{"invalid": why}` or `{"error": "Type: message"}`. Whatever the
function prints goes to stderr, so it cannot corrupt the answers. Kept free of heavy imports: it
starts once per worker and again after each killed call."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from typing import Any


def to_score(value: Any) -> float | str:
    """A reward function's return value as a finite float, or why it is not one."""
    if isinstance(value, dict):
        if "score" not in value:
            return f"returned a dict without 'score' (keys: {sorted(map(str, value))[:8]})"
        value = value["score"]
    if isinstance(value, bool):
        return "returned a bool, not a number"
    try:
        score = float(value)  # numpy and torch scalars too
    except (TypeError, ValueError):
        return f"returned {type(value).__name__}, not a number"
    return score if math.isfinite(score) else f"returned {score}"


def resolve(ref: str) -> Any:
    module_name, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{ref} is a {type(obj).__name__}, not a function")
    return obj


def main(argv: list[str]) -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    ref, paths = argv[0], argv[1:]
    sys.path[:0] = [os.path.abspath(p) for p in paths]
    try:
        fn = resolve(ref)
    except BaseException as e:  # the user's module may raise anything on import
        answer({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    answer({"ready": True})
    for line in sys.stdin:
        try:
            kwargs = json.loads(line)
            value = fn(**kwargs)
        except BaseException as e:
            answer({"error": f"{type(e).__name__}: {e}"})
            continue
        score = to_score(value)
        answer({"score": score} if isinstance(score, float) else {"invalid": score})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
