"""Weights out: the committed version's snapshot pushed to every serving engine (a sparse delta
from the version they last took where it can), one push at a time in the background, and a resync
that asks the engines which version they hold. Only the leading trainer pushes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.logging import get_logger
from services.common.membership import SERVING_ROLES, Membership
from services.common.metrics import trainer_metrics
from services.common.tracing import tracer
from services.learning.snapshot import Snapshot
from services.trainer.weight_push import PushResult, WeightPusher

if TYPE_CHECKING:
    from services.learning.learner import Learner


class WeightDistribution:
    def __init__(
        self,
        push_delta: bool,
        bus: Bus,
        membership: Membership,
        learner: Learner,
        pusher: WeightPusher,
        leading: Callable[[], bool],
        token: Callable[[], int],
    ):
        self.push_delta, self.bus, self.membership, self.learner, self.pusher = (
            push_delta,
            bus,
            membership,
            learner,
            pusher,
        )
        self.leading, self.token = leading, token
        self.log = get_logger(component="trainer")
        self.snap: Snapshot | None = None
        """The current version's weights as pushed (taken right after its commit)."""
        self.base: Snapshot | None = None
        """The last version engines took: sparse deltas are taken from it."""
        self.synced: dict[str, int] = {}
        """Engine address -> the version it holds (as last pushed or asked)."""
        self._want_push = asyncio.Event()
        self._pushing = asyncio.Lock()
        self._push_parent: Any = None
        """The trace context of the step whose version the next push carries (None: a resync)."""
        self._refreshing: asyncio.Task[None] | None = None

    @property
    def version(self) -> int:
        return self.learner.state.version

    def forget(self) -> None:
        """The weights were rolled back: nothing derived from the dropped ones is pushed."""
        self.snap = self.base = None

    async def snapshot(self) -> None:
        """A step committed: its weights are taken now, so the next step cannot change what is
        pushed while it streams to the engines in the background."""
        self.snap = await asyncio.to_thread(self.learner.snapshot)

    def request(self, parent: Any) -> None:
        """Asks for a push of the current version; `parent`: the trace of the step that made it."""
        self._push_parent = parent  # weights.push: a child of this step
        self._want_push.set()

    def want_push(self) -> None:
        """Engines that joined the plan (lent ones) get the current version without waiting for
        the resync."""
        self._want_push.set()

    def _addresses(self) -> list[str]:
        return [a.weight_sync_addr for a in self.membership.peers(*SERVING_ROLES) if a.weight_sync_addr]

    def all_synced(self) -> bool:
        return all(self.synced.get(a) == self.version for a in self._addresses())

    async def refresh(self) -> None:
        """What the engines say, not what this trainer remembers pushing: an engine restarted at the
        same address (a pod keeps its name and port) is back at version 0; those behind get a push.
        Never beside a push: answers given before it landed would overwrite what it left."""
        if self.version > 0:
            async with self._pushing:
                answers = await self.pusher.versions(self._addresses())
            self.synced.update(answers)
            if not self.all_synced():
                self._want_push.set()

    def refresh_soon(self) -> None:
        """`refresh` in the background, one at a time: asking every engine its version is one call
        each (at 1,024 engines 10-25 s of this machine's time), which the next step must not wait
        for."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = self.bus.spawn(self.refresh())

    async def push_loop(self) -> None:
        """Pushes the newest version to the engines that lack it whenever asked (after a commit,
        or by the resync); one push at a time, and a version superseded while waiting is skipped."""
        while True:
            await self._want_push.wait()
            self._want_push.clear()
            try:
                await self.push_current(only_missing=True)
            except Exception:  # a push must never end the loop: the resync asks again
                self.log.exception("weights_push_error")

    async def push_current(self, only_missing: bool = False) -> tuple[float, int, dict[str, PushResult]]:
        """Pushes the current version to the plan's engines (or those lacking it) under `weights.push`."""
        if not self.leading():
            return 0.0, 0, {}
        addrs = self._addresses()
        if only_missing:
            addrs = [a for a in addrs if self.synced.get(a) != self.version]
        if not addrs or self.version == 0:
            return 0.0, 0, {}
        async with self._pushing:
            if self.snap is None or self.snap.version != self.version:
                self.snap = await asyncio.to_thread(self.learner.snapshot)
            snap = self.snap
            base = self.base if self.push_delta and self.base is not None else None
            parent, self._push_parent = self._push_parent, None
            with tracer().start_as_current_span("weights.push", context=parent) as span:
                start = time.perf_counter()
                results = await self.pusher.push(snap, self.token(), addrs, base)
                seconds = time.perf_counter() - start
                for addr, r in results.items():
                    if r.in_sync:
                        self.synced[addr] = snap.version
                if any(r.in_sync for r in results.values()):
                    self.base = snap
                cost = self.pusher.last
                span.set_attribute("libra.weight_version", snap.version)
                span.set_attribute("libra.push_bytes", cost.uploaded)
                span.set_attribute("libra.delta_bytes", cost.delta_bytes)
                span.set_attribute("libra.engines_in_sync", sum(r.in_sync for r in results.values()))
        trainer_metrics().push_seconds.observe(seconds)
        trainer_metrics().push_bytes.inc(cost.uploaded)
        self.log.info(
            "weights_pushed",
            policy_version=snap.version,
            engines=len(addrs),
            in_sync=sum(r.in_sync for r in results.values()),
            size_bytes=snap.nbytes,
            uploaded_bytes=cost.uploaded,
            delta_bytes=cost.delta_bytes,
            delta_engines=cost.delta_engines,
            push_s=round(seconds, 3),
        )
        applied = sorted(a for a, r in results.items() if r.in_sync and r.code != "stale_version")
        if applied:
            await self.bus.publish(
                subjects.WEIGHTS_UPDATED,
                ev.WeightsUpdated(
                    version=snap.version,
                    checksum=snap.checksum,
                    size_bytes=snap.nbytes,
                    push_s=seconds,
                    engines=applied,
                    train_step=self.learner.state.step,
                    uploaded_bytes=cost.uploaded,
                    delta_bytes=cost.delta_bytes,
                    delta_engines=cost.delta_engines,
                    dtype=snap.dtype,
                    relayed_engines=sum(1 for a in applied if results[a].via),
                ),
            )
        return seconds, cost.uploaded, results
