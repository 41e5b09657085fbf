"""An engine's training side, while the planner has it in the hybrid pool.

The states, each published on `hybrid.state` with the worker's lease token and what it took:
`drained` (the engine handed its turns back), `fetched` (the job's model is loaded for training;
its weights come from the trainer when it joins), `ready` (asks the trainer for a place; repeated
until one comes), `joined` (met the trainer's generation and holds its weights: active from here),
`failed` (a generation did not form or broke: the worker asks again), `released` (the plan moved
it back out and the trainer has let it go; it serves turns again). Every state change of the
plan is acted on: a worker released before it joined goes straight back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import ev
from services.common.logging import get_logger
from services.common.runconfig import LearnJob
from services.common.tasks import in_daemon_thread
from services.common.tracing import tracer

READY_EVERY_S = 5.0
"""How often a worker waiting for a place says ready again (a trainer that restarted, a lost message)."""


class TrainingSide:
    def __init__(self, job: LearnJob, bus: Bus, worker_id: str, in_role: Callable[[], int | None]):
        """`in_role()` is the worker's lease token while the plan gives it the hybrid role, else None."""
        self.job, self.bus, self.worker_id, self.in_role = job, bus, worker_id, in_role
        self.group: ev.HybridGroup | None = None
        self._group_seen = asyncio.Event()
        self.log = get_logger(component="hybrid")
        self.generations = 0
        self._span: Any = None
        """The `hybrid.stint` span of the current move into training (its steps are events)."""
        self.latest: ev.HybridState | None = None
        """The last step this worker reported (said again when the plan re-assigns it)."""

    async def start(self) -> None:
        await self.bus.subscribe(subjects.HYBRID_GROUP, ev.HybridGroup, self._on_group)

    async def _on_group(self, g: ev.HybridGroup, _: Envelope) -> None:
        if (
            self.group is None
            or g.generation > self.group.generation
            or g.trainer_token > self.group.trainer_token
        ):
            self.group = g
            self._group_seen.set()

    def plan_changed(self) -> None:
        """Wakes a wait, to look at the role again. A worker moved back into the hybrid role
        before it left the trainer's group says again where it is: whoever moved it may think it
        starts over."""
        self._group_seen.set()
        last = self.latest
        if last is not None and self.in_role() == last.fencing_token and last.state in ("fetched", "joined"):
            self.bus.spawn(self.bus.publish(subjects.HYBRID_STATE, last))

    async def state(
        self,
        state: str,
        token: int,
        seconds: float = 0.0,
        generation: int = 0,
        detail: str = "",
        handed_back: int = 0,
    ) -> None:
        self.log.info(
            f"hybrid_{state}", fencing_token=token, seconds=round(seconds, 3), generation=generation
        )
        msg = ev.HybridState(
            worker_id=self.worker_id,
            state=state,
            fencing_token=token,
            seconds=seconds,
            generation=generation,
            detail=detail[:500],
            turns_handed_back=handed_back,
        )
        if state != "ready":
            self.latest = msg
            if self._span is not None:
                self._span.add_event(state, {"libra.seconds": seconds, "libra.generation": generation})
        await self.bus.publish(subjects.HYBRID_STATE, msg)

    async def run(self, token: int, drain_s: float) -> None:
        """From drained to released, while the plan keeps the hybrid role under `token`."""
        attrs: dict[str, Any] = {"libra.worker_id": self.worker_id, "libra.fencing_token": token}
        self._span = tracer().start_span("hybrid.stint", attributes=attrs)
        try:
            await self._run(token, drain_s)
        finally:
            self._span.end()
            self._span = None

    async def _run(self, token: int, drain_s: float) -> None:
        from services.learning.hybrid import GroupBroken
        from services.learning.recipe import replica_for

        await self.state("drained", token, drain_s)
        start = time.monotonic()
        try:
            replica = await asyncio.to_thread(replica_for, self.job)
        except Exception as err:  # e.g. an emulated engine of a model that is not here
            await self.state(
                "failed", token, time.monotonic() - start, detail=f"cannot load the model: {err}"
            )
            return
        await self.state("fetched", token, time.monotonic() - start)
        entered: float | None = None
        seen = self.group.generation if self.group is not None else 0
        loop = asyncio.get_running_loop()
        while self.in_role() == token:
            self._group_seen.clear()
            g = self.group
            if g is None or g.generation <= seen:
                await self.state("ready", token)
                await _wait(self._group_seen.wait(), READY_EVERY_S)
                continue
            seen = g.generation
            members = list(g.members)
            if self.worker_id not in members or len(g.member_tokens) != len(members):
                continue
            rank = members.index(self.worker_id) + 1
            if g.member_tokens[rank - 1] != token:
                continue  # a generation for an older incarnation of this worker
            host, port = g.store_addr.rsplit(":", 1)
            joining = time.monotonic()

            def joined(nbytes: float, gen: int = g.generation, t0: float = joining) -> None:
                secs = time.monotonic() - t0
                asyncio.run_coroutine_threadsafe(
                    self.state("joined", token, secs, gen, f"{int(nbytes)} bytes"), loop
                )

            serve = functools.partial(
                replica.serve,
                host,
                int(port),
                g.generation,
                g.rendezvous_key,
                rank,
                1 + len(g.members),
                g.timeout_s,
                joined,
            )
            try:
                await in_daemon_thread(serve)
                self.generations += 1
                entered = entered if entered is not None else joining
            except GroupBroken as err:
                await self.state("failed", token, time.monotonic() - joining, g.generation, str(err))
        in_training = time.monotonic() - entered if entered is not None else 0.0
        await self.state("released", token, in_training, detail=f"{replica.steps} steps computed")


async def _wait(aw: Awaitable[Any], timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(aw, timeout)
