"""User code the scheduler runs in worker processes (`python -m services.scheduler.plugin_worker`):
rewards (`task.reward: module:function`) and agent environments (`task.environment`).

A call that raises, returns nonsense, hangs past its timeout or kills its process fails only the
trajectory it was for, with a typed code (`<kind>_error`, `<kind>_invalid`, `<kind>_timeout`,
`<kind>_crashed`); a killed or dead process is replaced before its next call.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from dataclasses import dataclass
from typing import Any

LOAD_TIMEOUT_S = 60.0
"""How long a worker may take to import the user's module."""


@dataclass(frozen=True)
class PluginFailure:
    """Why user code gave no usable answer: `code` is `<kind>_error` (it raised), `<kind>_invalid`
    (a return value of the wrong kind), `<kind>_timeout` or `<kind>_crashed`."""

    code: str
    message: str


class PluginLoadError(RuntimeError):
    """The configured `module:name` cannot be imported or is not callable."""


class PluginProcess:
    """One worker process of `kind` (reward | env) running `ref`, answering one JSON line per request."""

    def __init__(self, kind: str, ref: str, plugin_paths: list[str], setting: str):
        self.kind, self.ref, self.plugin_paths, self.setting = kind, ref, plugin_paths, setting
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        """Raises PluginLoadError when the user's code cannot be loaded."""
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.scheduler.plugin_worker",
            self.kind,
            self.ref,
            *self.plugin_paths,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=16 * 1024 * 1024,
        )
        try:
            hello = await self._read(LOAD_TIMEOUT_S)
        except EOFError:
            hello = {"error": "the process exited while loading"}
        if hello is None or not hello.get("ready"):
            await self.kill()
            why = hello.get("error") if hello else f"no answer within {LOAD_TIMEOUT_S:g} s"
            raise PluginLoadError(f"{self.setting} {self.ref!r} cannot be loaded: {why}")

    async def _read(self, timeout_s: float) -> dict[str, Any] | None:
        assert self.proc is not None and self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        except TimeoutError:
            return None
        if not line:
            raise EOFError("the process exited")
        out = json.loads(line)
        assert isinstance(out, dict)
        return out

    async def call(self, request: dict[str, Any], timeout_s: float) -> Any | PluginFailure:
        """The user code's answer to one request, or why there is none (a process that hangs past
        `timeout_s` or dies is killed; the next call restarts it)."""
        if not self.alive:
            try:
                await self.start()
            except PluginLoadError as e:  # it loaded before; a restart that cannot is a crash
                return PluginFailure(f"{self.kind}_crashed", str(e))
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(request, default=str).encode() + b"\n")
            await self.proc.stdin.drain()
            answer = await self._read(timeout_s)
        except (EOFError, ConnectionError, BrokenPipeError) as e:
            await self.kill()
            return PluginFailure(f"{self.kind}_crashed", f"the {self.kind} process died: {e}")
        if answer is None:
            await self.kill()
            return PluginFailure(f"{self.kind}_timeout", f"no answer within {timeout_s:g} s")
        if "error" in answer:
            return PluginFailure(f"{self.kind}_error", str(answer["error"])[:500])
        if "invalid" in answer:
            return PluginFailure(f"{self.kind}_invalid", str(answer["invalid"])[:500])
        return answer["ok"]

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
