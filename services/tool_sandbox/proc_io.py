"""Watching a sandbox's processes from the host: its stdout and stderr read without blocking under one
shared byte cap, and its process tree read from /proc (for CPU accounting and reaping)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path


def resolve(future: asyncio.Future[None]) -> None:
    """Marks a readiness future done (an event-loop reader or writer callback)."""
    if not future.done():
        future.set_result(None)


class OutputCapture:
    """Non-blocking reader of stdout and stderr with one shared byte cap."""

    def __init__(self, fds: dict[str, int], limit: int, on_exceed: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._limit = limit
        self._on_exceed = on_exceed
        self.buffers = {name: bytearray() for name in fds}
        self.total = 0
        self.exceeded = False
        self._open = dict(fds)
        self.done: asyncio.Future[None] = self._loop.create_future()
        for name, fd in fds.items():
            os.set_blocking(fd, False)
            self._loop.add_reader(fd, self._readable, name, fd)

    def _readable(self, name: str, fd: int) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(name)
            return
        room = self._limit - self.total
        if room > 0:
            self.buffers[name] += data[:room]
        self.total += len(data)
        if self.total > self._limit and not self.exceeded:
            self.exceeded = True
            self._on_exceed()

    def _close(self, name: str) -> None:
        fd = self._open.pop(name, None)
        if fd is not None:
            self._loop.remove_reader(fd)
        if not self._open and not self.done.done():
            self.done.set_result(None)

    def stop(self) -> None:
        for name in list(self._open):
            self._close(name)


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[str]:
    """The pids of its direct children (as strings; none if it is gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return [c for t in tasks for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except OSError:
        return []


def descendants(pid: int) -> list[int]:
    """It and everything below it (at most 4096 processes)."""
    found, frontier = [pid], [pid]
    while frontier and len(found) < 4096:
        frontier = [int(c) for p in frontier for c in children(p)]
        found += frontier
    return found
