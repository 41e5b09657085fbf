"""`python -m services.scheduler.agent_worker MODULE:FUNCTION [PLUGIN_PATH ...]`: one process running
a user's agent (`task.agent`) for many trajectories at once.

The agent is a function `agent(sample, base_url, api_key)`, async or not, that runs its own loop
against Libra's OpenAI-compatible endpoint (`base_url`, with the trajectory's own `api_key`) and
returns the trajectory's reward (a number), or None to leave the scoring to `task.reward`.

Requests are JSON lines on stdin: `{"op": "run", "id": TRAJECTORY, "sample": {...}, "base_url":
..., "api_key": ...}` starts one run; `{"op": "cancel", "id": TRAJECTORY}` cancels it (a plain
function's thread runs on, its answer dropped). Each run is answered by one JSON line on this
process's own copy of stdout, `{"id": TRAJECTORY, "ok": reward}`, `{"id": ..., "invalid": why}` or
`{"id": ..., "error": "Type: message"}`; whatever the agent prints goes to stderr.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from services.scheduler.plugin_worker import die_with_parent, resolve, to_score, where


async def run_one(agent: Callable[..., Any], req: dict[str, Any]) -> dict[str, Any]:
    kwargs = {"sample": req.get("sample", {}), "base_url": req["base_url"], "api_key": req["api_key"]}
    try:
        if inspect.iscoroutinefunction(agent):
            value = await agent(**kwargs)
        else:
            value = await asyncio.to_thread(agent, **kwargs)
    except asyncio.CancelledError:
        raise
    except BaseException as e:  # the user's code may raise anything
        return {"id": req["id"], "error": f"{type(e).__name__}: {e}{where(e)}"}
    if value is None:
        return {"id": req["id"], "ok": None}
    score = to_score(value)
    if isinstance(score, str):
        return {"id": req["id"], "invalid": score}
    return {"id": req["id"], "ok": score}


async def serve(agent: Callable[..., Any], out: TextIO) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=16 * 1024 * 1024)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    runs: dict[str, asyncio.Task[None]] = {}

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    async def run(req: dict[str, Any]) -> None:
        try:
            answer(await run_one(agent, req))
        finally:
            runs.pop(req["id"], None)

    while line := await reader.readline():
        try:
            req = json.loads(line)
            op, key = req["op"], str(req["id"])
        except (ValueError, KeyError, TypeError):
            continue  # the scheduler writes these lines; one it did not is ignored
        if op == "run" and key not in runs:
            runs[key] = asyncio.create_task(run(req))
        elif op == "cancel" and key in runs:
            runs.pop(key).cancel()
    for task in runs.values():
        task.cancel()


def main(argv: list[str]) -> int:
    die_with_parent()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    ref, paths = argv[0], argv[1:]
    sys.path[:0] = [os.path.abspath(p) for p in paths]
    try:
        agent = resolve(ref)
    except BaseException as e:  # the user's module may raise anything on import
        out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        return 1
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    asyncio.run(serve(agent, out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
