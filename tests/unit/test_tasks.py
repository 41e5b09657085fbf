"""cancel_and_wait stops tasks that swallow a cancellation, and gives up on ones that never stop."""

from __future__ import annotations

import asyncio

from services.common.tasks import cancel_and_wait


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
