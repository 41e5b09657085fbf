"""The batching engine: a queue of requests in front of one backend, and the weight version.

One loop takes up to `max_batch` waiting requests, runs them as one batch, and resolves their
futures; new requests queue meanwhile and form the next batch. Weight swaps take the same lock as
a batch, so new weights land between batches and every output names the version that produced it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from services.common.logging import get_logger
from services.rollout_engine.backends.base import Backend, GenerationAborted, GenOutput, GenRequest


class EngineClosed(Exception):
    """The engine stopped before the request ran; the caller hands it back."""


@dataclass
class Finished:
    output: GenOutput
    policy_version: int
    queue_s: float
    generate_s: float


@dataclass
class _Queued:
    req: GenRequest
    enqueued: float
    future: asyncio.Future[Finished] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class BatchingEngine:
    def __init__(self, backend: Backend, max_batch: int):
        self.backend = backend
        self.max_batch = max_batch
        self.version = 0
        self.checksum = ""
        self.running = 0
        self.tokens_generated = 0
        self._queue: deque[_Queued] = deque()
        self._wake = asyncio.Event()
        self._version_changed = asyncio.Condition()
        self._step = asyncio.Lock()
        self._closed = False
        self._task: asyncio.Task[None] | None = None
        self.log = get_logger(component="engine")

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batching-engine")

    async def submit(self, req: GenRequest) -> Finished:
        if self._closed:
            raise EngineClosed("engine is shutting down")
        item = _Queued(req, time.monotonic())
        self._queue.append(item)
        self._wake.set()
        return await item.future

    async def wait_for_version(self, version: int, timeout: float) -> bool:
        """Waits until weights of at least `version` are live; False on timeout or shutdown."""

        async def reached() -> None:
            async with self._version_changed:
                await self._version_changed.wait_for(lambda: self.version >= version or self._closed)

        try:
            await asyncio.wait_for(reached(), timeout)
        except TimeoutError:
            return False
        return self.version >= version

    async def swap_weights(self, state_dict: dict[str, Any], version: int, checksum: str) -> bool:
        """Applies new weights between batches; False (nothing changed) if `version` is not newer."""
        async with self._step:
            if version <= self.version:
                return False
            await self.backend.swap_weights(state_dict, version)
            self.version, self.checksum = version, checksum
        async with self._version_changed:
            self._version_changed.notify_all()
        self.log.info("weights_swapped", policy_version=version)
        return True

    async def close(self, timeout: float) -> None:
        """Stops taking work, fails queued requests with EngineClosed, lets the running batch end."""
        self._closed = True
        while self._queue:
            item = self._queue.popleft()
            if not item.future.done():
                item.future.set_exception(EngineClosed("engine is shutting down"))
        async with self._version_changed:
            self._version_changed.notify_all()
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except TimeoutError:
                self.log.warning("batch_aborted", running=self.running)
                self.backend.abort()
                try:
                    await asyncio.wait_for(asyncio.shield(self._task), timeout)
                except TimeoutError:
                    self._task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._task

    async def _loop(self) -> None:
        with contextlib.suppress(GenerationAborted):
            await self._serve_batches()

    async def _serve_batches(self) -> None:
        while not self._closed:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
            await self._run(batch)

    async def _run(self, batch: list[_Queued]) -> None:
        async with self._step:
            started = time.monotonic()
            self.running = len(batch)
            try:
                outputs = await self.backend.generate([b.req for b in batch])
            except (GenerationAborted, asyncio.CancelledError) as err:
                for b in batch:
                    if not b.future.done():
                        b.future.set_exception(EngineClosed(f"engine is shutting down: {err}"))
                raise
            except Exception as err:
                self.log.exception("batch_failed", batch=len(batch))
                for b in batch:
                    if not b.future.done():
                        b.future.set_exception(err)
                return
            finally:
                self.running = 0
            version = self.version
        took = time.monotonic() - started
        for b, out in zip(batch, outputs, strict=True):
            self.tokens_generated += len(out.token_ids)
            if not b.future.done():
                b.future.set_result(Finished(out, version, started - b.enqueued, took))
