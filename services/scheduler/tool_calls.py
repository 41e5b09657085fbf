"""Every tool call the scheduler has out at the sandbox, by call id, in one place: a trajectory's
tool turn (waited for by its trajectory) or a reward's code run (`code_tests`, waited for by a
future). A return finds its caller here once; a second return of the same call finds nobody."""

from __future__ import annotations

import asyncio

from services.common.contracts import ev

Waiter = str | asyncio.Future[ev.ToolReturn]
"""A trajectory id, or the future a reward's code run awaits."""


class ToolCalls:
    def __init__(self) -> None:
        self._waiting: dict[str, Waiter] = {}

    def __contains__(self, call_id: str) -> bool:
        return call_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def expect(self, call_id: str, waiter: Waiter) -> None:
        self._waiting[call_id] = waiter

    def forget(self, call_id: str) -> None:
        """Nobody waits for it any more (given up, timed out, its trajectory ended)."""
        self._waiting.pop(call_id, None)

    def answered(self, ret: ev.ToolReturn) -> str | None:
        """The trajectory that waited for this return, or None: a reward's run (its future now
        holds the return), or nobody (answered already, or not one of ours)."""
        waiter = self._waiting.pop(ret.call_id, None)
        if isinstance(waiter, asyncio.Future):
            if not waiter.done():
                waiter.set_result(ret)
            return None
        return waiter
