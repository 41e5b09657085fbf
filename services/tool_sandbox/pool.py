"""A pool of warm sandboxes: started ahead of time so interpreter start-up is off the critical path.

Each warm sandbox is single-use (no state crosses calls); the pool only moves its start-up earlier.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import structlog

from services.tool_sandbox.isolation import SandboxProcess

log = structlog.get_logger()


class WarmPool:
    def __init__(self, spawn: Callable[[], SandboxProcess], size: int) -> None:
        self._spawn = spawn
        self.size = size
        self._idle: deque[SandboxProcess] = deque()
        self._closed = False
        self._refill_scheduled = False
        self.hits = 0
        self.misses = 0
        self.spawn_failures = 0

    def start(self) -> None:
        self._refill()

    @property
    def ready(self) -> int:
        return len(self._idle)

    def acquire(self) -> SandboxProcess:
        """A warm sandbox if one is alive, else a freshly started one (a miss)."""
        while self._idle:
            sandbox = self._idle.popleft()
            if sandbox.alive():
                self.hits += 1
                self._schedule_refill()
                return sandbox
            sandbox.close_pipes()
        self.misses += 1
        self._schedule_refill()
        return self._spawn()

    def _schedule_refill(self) -> None:
        if self.size and not self._refill_scheduled and not self._closed:
            self._refill_scheduled = True
            asyncio.get_running_loop().call_soon(self._refill)

    def _refill(self) -> None:
        """Top up one sandbox per loop turn so refilling never holds the event loop for long."""
        self._refill_scheduled = False
        if self._closed or len(self._idle) >= self.size:
            return
        try:
            self._idle.append(self._spawn())
        except OSError as exc:
            self.spawn_failures += 1
            log.warning("sandbox_pool_spawn_failed", error=str(exc))
            return
        self._schedule_refill()

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = list(self._idle), deque()
        await asyncio.gather(*(sandbox.terminate() for sandbox in idle), return_exceptions=True)
        for sandbox in idle:
            sandbox.close_pipes()
