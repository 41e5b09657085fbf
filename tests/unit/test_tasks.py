"""cancel_and_wait stops tasks that swallow a cancellation, and gives up on ones that never stop;
`retried` retries until an answer or a stop."""

from __future__ import annotations

import asyncio

from services.common import tasks
from services.common.tasks import cancel_and_wait, retried


async def _swallows(times: int, ticks: list[int], stop: asyncio.Event | None = None) -> None:
    """A loop like a service's whose awaited call swallowed the cancellation `times` times."""
    swallowed = 0
    while stop is None or not stop.is_set():
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if swallowed >= times:
                raise
            swallowed += 1
        ticks.append(1)


async def test_a_task_that_swallowed_cancellations_is_cancelled_again_until_it_ends() -> None:
    ticks: list[int] = []
    task = asyncio.ensure_future(_swallows(3, ticks))
    await asyncio.sleep(0.05)
    left = await cancel_and_wait([task], timeout_s=5, retry_s=0.02)
    assert left == set() and task.cancelled()
    # a plain cancel-and-await would have waited forever here: the first cancel did not end it


async def test_a_task_that_never_stops_is_returned_after_the_bound() -> None:
    stop = asyncio.Event()
    task = asyncio.ensure_future(_swallows(10**9, [], stop))
    await asyncio.sleep(0.05)
    left = await cancel_and_wait([task], timeout_s=0.2, retry_s=0.02)
    assert left == {task} and not task.done()  # the caller learns which, and the log says so
    stop.set()  # lets it end
    await asyncio.wait({task}, timeout=5)
    assert task.done()


async def test_finished_and_failed_tasks_are_fine() -> None:
    async def boom() -> None:
        raise RuntimeError("x")

    done = asyncio.ensure_future(asyncio.sleep(0))
    failed = asyncio.ensure_future(boom())
    await asyncio.sleep(0.01)
    assert await cancel_and_wait([done, failed]) == set()


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def warning(self, event: str, **kv) -> None:
        self.lines.append((event, kv))


async def _no_pause(attempt: int) -> None:
    await asyncio.sleep(0)


async def test_retried_answers_after_failures_and_logs_every_nth_one(monkeypatch) -> None:
    monkeypatch.setattr(tasks, "retry_pause", _no_pause)
    calls = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) <= 12:
            raise ConnectionError("away")
        return "answer"

    log = _Log()
    assert await retried(flaky, log, "waiting", warn_every=10, fields={"stream": "S"}) == "answer"
    assert len(calls) == 13
    assert [kv["attempt"] for _, kv in log.lines] == [1, 11]
    assert log.lines[0] == ("waiting", {"stream": "S", "error": "ConnectionError: away", "attempt": 1})


async def test_retried_gives_up_with_none_once_stopped(monkeypatch) -> None:
    monkeypatch.setattr(tasks, "retry_pause", _no_pause)
    stop = asyncio.Event()
    calls = []

    async def never() -> str:
        calls.append(1)
        if len(calls) == 3:
            stop.set()
        raise ConnectionError("away")

    assert await retried(never, _Log(), "waiting", stop=stop) is None
    assert len(calls) == 3
