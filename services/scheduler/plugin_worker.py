"""`python -m services.scheduler.plugin_worker {reward|env} MODULE:NAME [PLUGIN_PATH ...]`: one
process running user code (a reward function, or an agent environment class) for the scheduler.

Reads one JSON object per line on stdin and answers one JSON line on its own copy of stdout, so that
whatever the user's code prints (it goes to stderr) cannot corrupt the answers. Answers are
`{"ok": value}`, `{"invalid": why}` (a return value of the wrong kind) or `{"error": "Type:
message"}`. Kept free of heavy imports: it starts once per worker and again after each killed call.

- `reward`: a request is the keyword arguments of the function; `ok` is the score (a finite float).
- `env`: a request is `{"op": "reset"|"step"|"tool_result"|"close", "id": TRAJECTORY, ...}`; one
  instance of the class per trajectory id, made at `reset` (with the request's `args` as its
  constructor's keyword arguments) and dropped at `close` (its own `close()` called, if it has one). See
  services/scheduler/environment.py for what each operation takes and returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO


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
        raise TypeError(f"{ref} is a {type(obj).__name__}, not a function or class")
    return obj


def where(err: BaseException) -> str:
    """Where the user's code raised: its innermost frame, as ` (at file:line in function)`."""
    tb = err.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f" (at {os.path.basename(code.co_filename)}:{tb.tb_lineno} in {code.co_name})"


PR_SET_PDEATHSIG = 1


class InvalidReturn(Exception):
    """The user's code returned something of the wrong kind (answered as `invalid`)."""


def reward_handler(fn: Callable[..., Any]) -> Callable[[dict[str, Any]], Any]:
    def handle(kwargs: dict[str, Any]) -> float:
        score = to_score(fn(**kwargs))
        if isinstance(score, str):
            raise InvalidReturn(score)
        return score

    return handle


def env_handler(factory: Callable[[], Any]) -> Callable[[dict[str, Any]], Any]:
    from services.scheduler.environment import prompt_of, step_of

    instances: dict[str, Any] = {}

    def handle(req: dict[str, Any]) -> Any:
        op, key = req.get("op"), str(req.get("id", ""))
        if op == "reset":
            env = instances[key] = factory(**(req.get("args") or {}))
            try:
                return prompt_of(env.reset(req.get("sample", {})))
            except ValueError as e:
                raise InvalidReturn(f"reset {e}") from None
        if op == "close":
            closer = getattr(instances.pop(key, None), "close", None)
            if callable(closer):
                with contextlib.suppress(Exception):  # the episode is over either way
                    closer()
            return None
        if key not in instances:
            raise LookupError(f"no environment for {key!r} (this worker restarted since its reset)")
        env = instances[key]
        if op == "step":
            try:
                return step_of(env.step(req.get("response", ""))).as_json()
            except ValueError as e:
                raise InvalidReturn(f"step {e}") from None
        if op == "tool_result":
            hook = getattr(env, "tool_result", None)
            if hook is not None:
                hook(req.get("tool", ""), req.get("status", ""), req.get("output", ""))
            return None
        raise ValueError(f"unknown operation {op!r}")

    return handle


HANDLERS = {"reward": reward_handler, "env": env_handler}


def die_with_parent() -> None:
    """Exits when the scheduler that started it dies, even killed with -9 and even while the user's
    code hangs: the kernel's parent-death signal on Linux, a watching thread elsewhere."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def answers_out() -> TextIO:
    """This process's own copy of stdout, for its answers; whatever the user's code prints (its
    stdout too) goes to stderr from now on, so that it cannot corrupt them."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def main(argv: list[str]) -> int:
    die_with_parent()
    out = answers_out()

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    kind, ref, paths = argv[0], argv[1], argv[2:]
    sys.path[:0] = [os.path.abspath(p) for p in paths]
    try:
        handle = HANDLERS[kind](resolve(ref))
    except BaseException as e:  # the user's module may raise anything on import
        answer({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return 1
    answer({"ready": True})
    for line in sys.stdin:
        try:
            value = handle(json.loads(line))
        except InvalidReturn as e:
            answer({"invalid": str(e)})
            continue
        except BaseException as e:
            answer({"error": f"{type(e).__name__}: {e}{where(e)}"})
            continue
        answer({"ok": value})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
