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

In the tool sandbox (`task.agent_sandbox`), `sandboxed` runs the agent once instead: the sandbox
has no network but its loopback, so a relay listens there and carries each connection to the Unix
socket the sandbox service bridges to the endpoint; the agent's `base_url` is the relay's.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import selectors
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from services.scheduler.plugin_worker import answers_out, die_with_parent, resolve, to_score, where


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


RELAY_HOST = "127.0.0.1"


def _carry(a: socket.socket, b: socket.socket) -> None:
    """Bytes both ways between two connected sockets until both sides have finished sending."""
    with a, b, selectors.DefaultSelector() as sel:
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        sending = 2
        while sending:
            for key, _ in sel.select():
                src, dst = key.fileobj, key.data
                assert isinstance(src, socket.socket)
                try:
                    data = src.recv(1 << 16)
                    if data:
                        dst.sendall(data)
                        continue
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    return
                sel.unregister(src)
                sending -= 1


def relay(socket_path: str) -> int:
    """A loopback port whose connections go on to `socket_path` (a Unix socket); its port."""
    server = socket.create_server((RELAY_HOST, 0))

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            up = socket.socket(socket.AF_UNIX)
            try:
                up.connect(socket_path)
            except OSError:
                conn.close()
                up.close()
                continue
            threading.Thread(target=_carry, args=(conn, up), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return int(server.getsockname()[1])


def sandboxed(spec: dict[str, Any]) -> int:
    """One run in the tool sandbox: `spec` is `{"ref": MODULE:FUNCTION}` or `{"command": [...]}`,
    with `"socket": PATH, "paths": [PLUGIN_PATH, ...], "sites": [...]`; the run (`{"id", "sample",
    "api_key"}`) is stdin, and the answer the last line on stdout: `serve`'s for a function (or
    `{"crashed": why}` when it cannot be loaded), `{"command": {"code", "stdout", "stderr"}}` for a
    command (services/scheduler/agents.py: command_outcome reads it)."""
    out = answers_out()
    paths = [str(p) for p in spec.get("paths", [])]
    sys.path[1:1] = paths
    req = json.loads(sys.stdin.read())
    base_url = f"http://{RELAY_HOST}:{relay(str(spec['socket']))}/v1"
    answer: dict[str, Any]
    if spec.get("command"):
        answer = {"id": req["id"], **_command(spec["command"], req, base_url, paths, spec.get("sites", []))}
    else:
        try:
            agent = resolve(str(spec["ref"]))
        except BaseException as e:  # the user's module may raise anything on import
            answer = {"id": req["id"], "crashed": f"task.agent cannot be loaded: {type(e).__name__}: {e}"}
        else:
            answer = asyncio.run(run_one(agent, {**req, "base_url": base_url}))
    out.write(json.dumps(answer) + "\n")
    out.flush()
    return 0


COMMAND_STDOUT_KEPT = 64 * 1024
"""The end of a sandboxed command's output that goes back (its reward is its last line)."""


def _command(
    command: list[str], req: dict[str, Any], base_url: str, paths: list[str], sites: list[str]
) -> dict[str, Any]:
    """Runs a `task.agent_command` as CommandAgents does beside the scheduler (its environment
    names the endpoint, the key and the row; the row is on stdin too; it runs in the first plugin
    path), with the sandbox's packages on PYTHONPATH for a Python program."""
    import subprocess

    from services.scheduler.agents import command_env

    row = json.dumps(req.get("sample", {}))
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LANG") if k in os.environ}
    env |= command_env(base_url, str(req["api_key"]), str(req["id"]), row)
    env["PYTHONPATH"] = os.pathsep.join([*paths, *sites])
    cwd = paths[0] if paths else None
    program = command[0]
    if cwd and not os.path.isabs(program) and os.path.exists(os.path.join(cwd, program)):
        program = os.path.join(cwd, program)  # a program of the job's own, as found beside the scheduler
    try:
        done = subprocess.run(
            [program, *command[1:]], input=row.encode() + b"\n", capture_output=True, cwd=cwd, env=env
        )
    except OSError as e:
        return {"crashed": f"the agent command could not start: {e}"}
    return {
        "command": {
            "code": done.returncode,
            "stdout": done.stdout[-COMMAND_STDOUT_KEPT:].decode(errors="replace"),
            "stderr": done.stderr[-4096:].decode(errors="replace"),
        }
    }


def main(argv: list[str]) -> int:
    die_with_parent()
    out = answers_out()
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
