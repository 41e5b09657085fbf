"""Stopping background tasks for sure, and waiting for blocking work that cannot be interrupted.

`task.cancel()` followed by `await task` can wait forever: on Python 3.11 a cancellation that
arrives just as an inner `asyncio.wait_for` (used inside nats-py and redis-py) completes is
swallowed, and a service loop then goes on ticking. Seen here: the planner's loop survived its
bus's close about once in 30 runs on a loaded machine, and the close waited for it forever.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from services.common.logging import get_logger

T = TypeVar("T")


async def retry_pause(attempt: int, step_s: float = 0.5, cap_s: float = 5.0) -> None:
    """The pause before retry `attempt` (1, 2, ...) of something that must eventually succeed
    (Redis or JetStream away for a while): `step_s` more per attempt, at most `cap_s`."""
    await asyncio.sleep(min(step_s * attempt, cap_s))


async def retried(
    op: Callable[[], Awaitable[T]],
    log: Any,
    event: str,
    *,
    stop: asyncio.Event | None = None,
    warn_every: int = 1,
    fields: dict[str, Any] | None = None,
) -> T | None:
    """`op()`'s answer once it gives one, for what must eventually succeed (Redis or JetStream away
    for a while): each failure is logged as `event` (with `fields`, the error and the attempt; every
    `warn_every`-th one) and followed by `retry_pause`. None if `stop` is set before an answer."""
    attempt = 0
    while stop is None or not stop.is_set():
        try:
            return await op()
        except Exception as err:
            attempt += 1
            if (attempt - 1) % warn_every == 0:
                log.warning(event, **(fields or {}), error=f"{type(err).__name__}: {err}", attempt=attempt)
            await retry_pause(attempt)
    return None


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


async def in_daemon_thread(fn: Callable[[], T]) -> T:
    """Runs blocking collective work off the event loop in a daemon thread: a gloo wait cannot be
    interrupted, and a process that is stopping must not wait for it to time out."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = fn()
        except BaseException as err:  # handed to the awaiting task, whatever it is
            loop.call_soon_threadsafe(_settle, fut, None, err)
        else:
            loop.call_soon_threadsafe(_settle, fut, result, None)

    threading.Thread(target=run, daemon=True, name="libra-hybrid").start()
    return await fut


def _settle(fut: asyncio.Future[T], result: T | None, err: BaseException | None) -> None:
    if fut.done():  # the awaiting task was cancelled meanwhile
        return
    if err is not None:
        fut.set_exception(err)
    else:
        fut.set_result(result)  # type: ignore[arg-type]


class Phases:
    """Where a stretch of work's time went, phase by phase, for a log line (`mark` ends a phase
    named `name`; `seconds` maps each phase to its seconds, rounded to the millisecond)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._mark = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.seconds[name] = round(now - self._mark, 3)
        self._mark = now
