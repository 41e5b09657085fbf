"""Stopping background tasks for sure.

`task.cancel()` followed by `await task` can wait forever: on Python 3.11 a cancellation that
arrives just as an inner `asyncio.wait_for` (used inside nats-py and redis-py) completes is
swallowed, and a service loop then goes on ticking. Seen here: the planner's loop survived its
bus's close about once in 30 runs on a loaded machine, and the close waited for it forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

from services.common.logging import get_logger


async def cancel_and_wait(
    tasks: Iterable[asyncio.Future[Any]], *, timeout_s: float = 10.0, retry_s: float = 0.25
) -> set[asyncio.Future[Any]]:
    """Cancels `tasks` and waits until they end, cancelling again every `retry_s` those that
    swallowed the cancellation, for at most `timeout_s`. Returns (and logs) those still running."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while pending:
        for t in pending:
            t.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(retry_s, left))
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: its owner logged it, or it does not matter any more
    if pending:
        get_logger().error("tasks_would_not_stop", tasks=sorted(repr(t) for t in pending)[:5])
    return pending
