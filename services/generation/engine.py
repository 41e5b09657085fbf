"""The continuous batcher: iteration-level scheduling of requests over one step backend.

Every iteration the loop drops the rows that finished, admits waiting requests (lowest priority
value first, then first come) while the batch has room, and asks the backend for one more token per
row. A request therefore joins a running batch at the next iteration and leaves it the moment it
ends, with its own stop strings and token budget; a long request never holds short ones back.

New weights land between two iterations (`swap_weights` takes the same lock as an iteration), and
running requests go on with them: each token records the weight version that sampled it. Unless
the backend says otherwise, running rows re-prefill their context with the new weights, since their
KV cache was computed with the old ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.logging import get_logger
from services.common.runconfig import SpeculativeConfig
from services.common.tasks import cancel_and_wait
from services.generation.backends.base import (
    Backend,
    Engine,
    EngineClosed,
    Finished,
    GenOutput,
    GenRequest,
    Join,
    StepBackend,
    VersionGate,
)
from services.generation.speculator import Row, Speculator
from services.generation.stops import StopMatcher


def engine_for(backend: Backend, max_batch: int, speculative: SpeculativeConfig | None = None) -> Engine:
    """The continuous batcher over a step backend (speculating where the backend verifies drafts
    and `speculative` asks for it); a backend that schedules its own iterations is its own engine."""
    if isinstance(backend, StepBackend):
        spec = speculative if speculative is not None and speculative.method != "off" else None
        if spec is not None and not backend.verifies_drafts:
            raise ValueError(
                f"the {backend.name} backend does not verify drafts: set rollout.speculative.method: off"
            )
        return ContinuousEngine(backend, max_batch, speculator=Speculator(spec) if spec is not None else None)
    engine: Engine = backend.make_engine(max_batch)
    return engine


@dataclass
class _Request:
    req: GenRequest
    enqueued: float
    future: asyncio.Future[Finished] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    slot: int = -1
    started: float = 0.0
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    stop: StopMatcher | None = None
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens(self) -> int:
        return len(self.req.prompt_ids) + len(self.ids)

    def result(self, finish: str) -> Finished:
        out = GenOutput(self.ids, self.logprobs, finish, self.versions, self.drafted, self.accepted)
        version = self.versions[0] if self.versions else -1
        return Finished(out, version, self.started - self.enqueued, time.monotonic() - self.started)


class ContinuousEngine(VersionGate):
    def __init__(
        self,
        backend: StepBackend,
        max_batch: int,
        static_batches: bool = False,
        speculator: Speculator | None = None,
    ):
        super().__init__()
        self.backend = backend
        self.max_batch = max_batch
        self.speculator = speculator
        """Drafts for the running rows (speculative decoding); None: plain decoding."""
        self.static_batches = static_batches
        """Baseline for benchmarks: admit only into an empty batch, so a batch runs until its
        longest row ends (static batching)."""
        self.tokens_generated = 0
        self.iterations = 0
        self._queue: list[tuple[int, int, _Request]] = []
        self._order = itertools.count()
        self._slots = itertools.count()
        self._running: dict[int, _Request] = {}
        self._leaving: list[int] = []
        self._reset = True  # the backend may hold rows of an earlier engine: start from an empty batch
        self._wake = asyncio.Event()
        self._step = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.log = get_logger(component="engine")

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="continuous-engine")

    async def submit(self, req: GenRequest) -> Finished:
        if self._closed:
            raise EngineClosed("engine is shutting down")
        item = _Request(req, time.monotonic())
        heapq.heappush(self._queue, (req.priority, next(self._order), item))
        self._wake.set()
        self.backend.interrupt()
        return await item.future

    async def swap_weights(self, state_dict: dict[str, Any], version: int, checksum: str) -> bool:
        """Applies new weights between two iterations; False (nothing changed) if `version` is not
        newer. Running requests continue on the new weights."""
        self.backend.interrupt()
        async with self._step:
            if version <= self.version:
                return False
            await self.backend.swap_weights(state_dict, version)
            self.version, self.checksum = version, checksum
            self._reset = self.backend.recompute_on_swap and bool(self._running)
        await self._swapped(version, self.running)
        return True

    async def apply_update(
        self,
        version: int,
        checksum: str,
        consume: Callable[[], Awaitable[None]],
        dirty: Callable[[], bool],
    ) -> bool:
        """New weights written in place between two iterations (see `Engine.apply_update`);
        running requests continue on them."""
        self.backend.interrupt()
        async with self._step:
            if version <= self.version:
                return False
            await self._write_or_tear(version, consume, dirty)
            await self.backend.weights_loaded(version)
            self.version, self.checksum, self._torn = version, checksum, False
            self._reset = self.backend.recompute_on_swap and bool(self._running)
        self._wake.set()
        await self._swapped(version, self.running)
        return True

    async def adopt(self, version: int) -> None:
        """Its backend serves a model whose owner changed the weights to `version` in place (the
        trainer's own, `HFBackend(model=...)`): tokens from here on are that version's."""
        self.backend.interrupt()
        async with self._step:
            if version == self.version:
                return
            self.version, self.checksum = version, ""
            self._reset = bool(self._running)
        self._wake.set()
        await self._swapped(version, self.running)

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """No iteration runs inside (the backend's model is its owner's meanwhile, e.g. to train)."""
        self.backend.interrupt()
        async with self._step:
            yield

    async def hand_back(self) -> int:
        """Ends every request it holds at once, between two iterations (the planner took the engine
        away): each finishes `handed_back` with the tokens it generated so far (a queued one with
        none), so the turn can continue elsewhere from there. Returns how many; requests sent
        afterwards are served as before."""
        n = 0
        self.backend.interrupt()
        async with self._step:
            now = time.monotonic()
            while self._queue:
                _, _, item = heapq.heappop(self._queue)
                if not item.future.done():
                    item.started = now
                    item.future.set_result(item.result("handed_back"))
                    n += 1
            for slot, item in list(self._running.items()):
                del self._running[slot]
                self._leaving.append(slot)
                if not item.future.done():
                    item.future.set_result(item.result("handed_back"))
                    n += 1
        self._wake.set()
        return n

    async def close(self, timeout: float) -> None:
        """Stops taking work, fails queued requests with EngineClosed, lets running ones finish for
        up to `timeout` seconds, then fails those too."""
        self._closed = True
        while self._queue:
            _, _, item = heapq.heappop(self._queue)
            if not item.future.done():
                item.future.set_exception(EngineClosed("engine is shutting down"))
        await self._announce()
        self._wake.set()
        if self._task is None:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._task), timeout)
        if not self._task.done():
            self.log.warning("requests_aborted", running=len(self._running))
            await cancel_and_wait([self._task])
        self._fail_running(EngineClosed("engine is shutting down"))

    def _fail_running(self, err: BaseException) -> None:
        for item in self._running.values():
            if not item.future.done():
                item.future.set_exception(err)
        self._running.clear()

    async def _loop(self) -> None:
        while True:
            idle = not self._running and not self._leaving and (self._closed or not self._queue)
            if idle or (self._torn and not self._closed):
                if self._closed:
                    return
                self._wake.clear()
                await self._wake.wait()  # a torn engine generates nothing until a full push lands
                continue
            try:
                await self._iterate()
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.log.exception("iteration_failed", running=len(self._running))
                self._fail_running(err)
                self._leaving.clear()
                self._reset = True

    def _admit(self) -> list[Join]:
        joins: list[Join] = []
        if self.static_batches and self._running:
            return joins
        held = sum(r.tokens for r in self._running.values())
        while self._queue and not self._closed and len(self._running) < self.max_batch:
            item = self._queue[0][2]
            ctx = len(item.req.prompt_ids)
            if self._running and not self.backend.admits(held, ctx):
                break
            heapq.heappop(self._queue)
            if item.future.done():  # its caller gave up
                continue
            item.slot, item.started = next(self._slots), time.monotonic()
            item.stop = StopMatcher(item.req.stop, self.backend.decode)
            self._running[item.slot] = item
            held += ctx
            joins.append(Join(item.slot, list(item.req.prompt_ids), item.req.temperature, item.req))
        return joins

    def _drafts(self, joins: list[Join], no_eos: frozenset[int]) -> dict[int, list[int]]:
        """Drafted tokens for the rows decoding this step: not those joining (they prefill), not
        those below their min_new_tokens (EOS is masked for them, which a draft would not see)."""
        if self.speculator is None:
            return {}
        joining = {j.slot for j in joins}
        rows = [
            Row(
                slot,
                r.req.prompt_id,
                r.req.group_id,
                r.req.prompt_ids + r.ids,
                r.req.max_new_tokens - len(r.ids),
            )
            for slot, r in self._running.items()
            if slot not in joining and slot not in no_eos and r.ids
        ]
        return self.speculator.drafts(rows) if rows else {}

    async def _iterate(self) -> None:
        async with self._step:
            reset, self._reset = self._reset, False
            leaves, self._leaving = self._leaving, []
            rejoins = (
                [
                    Join(r.slot, r.req.prompt_ids + r.ids, r.req.temperature, r.req)
                    for r in self._running.values()
                ]
                if reset
                else []
            )
            joins = rejoins + self._admit()
            no_eos = frozenset(slot for slot, r in self._running.items() if len(r.ids) < r.req.min_new_tokens)
            drafts = self._drafts(joins, no_eos)
            began = time.monotonic()
            sampled = await self.backend.step(joins, leaves, reset, no_eos, drafts or None)
            if self.speculator is not None and not joins:
                width = 1 + max((len(d) for d in drafts.values()), default=0)
                self.speculator.stepped(
                    len(sampled) * width,
                    time.monotonic() - began,
                    rows=len(sampled),
                    emitted=sum(len(e) for e in sampled.values()),
                )
            version = self.version
        self.iterations += 1
        for slot, emitted in sampled.items():
            item = self._running.get(slot)
            if item is None:
                continue
            if item.future.done():  # cancelled by its caller: it leaves without a result
                del self._running[slot]
                self._leaving.append(slot)
                continue
            if slot in drafts:
                assert self.speculator is not None
                self.speculator.verified(slot, len(drafts[slot]), len(emitted))
                item.drafted += len(drafts[slot])
                item.accepted += len(emitted) - 1
            self._emit(slot, item, emitted, version)

    def _emit(self, slot: int, item: _Request, emitted: list[tuple[int, float]], version: int) -> None:
        """Appends a row's tokens of this step, in order, up to the one that ends it."""
        eos = self.backend.eos_token_ids
        for token, logprob in emitted:
            item.ids.append(token)
            item.logprobs.append(logprob)
            item.versions.append(version)
            self.tokens_generated += 1
            finish = None
            early = len(item.ids) < item.req.min_new_tokens
            if not early and (token in eos or (item.stop is not None and item.stop.matches(item.ids))):
                finish = "stop"
            elif len(item.ids) >= item.req.max_new_tokens:
                finish = "length"
            if finish is not None:
                del self._running[slot]
                self._leaving.append(slot)
                if not item.future.done():
                    item.future.set_result(item.result(finish))
                if self.speculator is not None:
                    self.speculator.finished(item.req.prompt_id, item.req.group_id, item.ids)
                return
        if item.req.on_tokens is not None and emitted:
            item.req.on_tokens([token for token, _ in emitted])
