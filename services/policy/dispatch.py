"""Scheduler-side queues over the engines, decided by a routing policy (C-MLFQ or a baseline).

The scheduler sends an engine no more turns than it decodes at once (its batch capacity, from its
load reports); the rest wait here, in the queue of their trajectory's bucket, ordered by the
policy. When a slot frees, the policy picks which waiting turn takes it — its own bucket's first,
else an aged turn of a neighbouring bucket (a steal, which moves the trajectory). After a tool
return the policy may move the trajectory to another bucket (a migration) for its next turn.

Pure: no I/O, time passed in; the service shell carries out what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.runconfig import BucketConfig
from services.policy.cmlfq import EngineView, RouteDecision
from services.policy.prefix_tree import ToolSignal
from services.policy.routing import POOL, Router, build_router


@dataclass
class EngineSlot:
    engine_id: str
    bucket: str
    capacity: int
    in_flight: int = 0

    @property
    def free(self) -> int:
        return self.capacity - self.in_flight


class Dispatcher:
    def __init__(self, router: Router, default_capacity: int, pool: str | None = None):
        """With `pool` set, every engine serves that one bucket whatever the plan says (the
        homogeneous baseline: one pool of engines, no buckets)."""
        self.router = router
        self.default_capacity = default_capacity
        self.pool = pool
        self.engines: dict[str, EngineSlot] = {}
        self.where: dict[str, str] = {}
        """Trajectory -> the bucket its next turn goes to."""
        self.queued: set[str] = set()
        self.migrations = 0
        self.decisions = 0

    # engines -------------------------------------------------------------------------------------

    def set_engines(self, buckets: dict[str, str]) -> None:
        """The plan's rollout engines (engine id -> bucket); in-flight counts of engines that stay
        are kept, engines that left are forgotten (their turns are re-sent by the caller)."""
        for wid in list(self.engines):
            if wid not in buckets:
                del self.engines[wid]
        for wid, bucket in buckets.items():
            bucket = self.pool or bucket
            slot = self.engines.setdefault(wid, EngineSlot(wid, bucket, self.default_capacity))
            slot.bucket = bucket

    def forget(self, engine_ids: list[str]) -> None:
        """Engines that left the plan or restarted: whatever they were running is gone."""
        for wid in engine_ids:
            self.engines.pop(wid, None)

    def set_capacity(self, engine_id: str, capacity: int) -> None:
        slot = self.engines.get(engine_id)
        if slot is not None and capacity > 0:
            slot.capacity = capacity

    def release(self, engine_id: str) -> None:
        """A turn on the engine ended (answered, failed, lost or timed out)."""
        slot = self.engines.get(engine_id)
        if slot is not None:
            slot.in_flight = max(0, slot.in_flight - 1)

    # trajectories --------------------------------------------------------------------------------

    def admit(self, traj_id: str, prompt_id: str, now: float) -> str:
        bucket = self.router.admit(traj_id, prompt_id, now, 0)
        self.where[traj_id] = bucket
        return bucket

    def place(self, traj_id: str, now: float, avoid: str | None = None) -> str | None:
        """An engine for the trajectory's next turn (its slot taken), or None: the turn waits in
        its bucket's queue until `next_for` hands it a slot. `avoid` (an engine whose answer to
        this turn was refused) is left out while any other engine could take it."""
        if traj_id in self.queued:
            return None
        self.decisions += 1
        bucket = self.where[traj_id]
        members = [e for e in self.engines.values() if e.bucket == bucket] or list(self.engines.values())
        if avoid is not None and any(e.engine_id != avoid for e in self.engines.values()):
            members = [e for e in members if e.engine_id != avoid] or [
                e for e in self.engines.values() if e.engine_id != avoid
            ]
        views = [EngineView(e.engine_id, e.in_flight, e.capacity) for e in members]
        engine_id = self.router.pick_engine(bucket, views, traj_id) if views else None
        if engine_id is None:
            self.router.enqueue(traj_id, now)
            self.queued.add(traj_id)
            return None
        self.engines[engine_id].in_flight += 1
        return engine_id

    def next_for(self, engine_id: str, now: float) -> str | None:
        """The waiting trajectory the policy gives a free slot of this engine, or None."""
        slot = self.engines.get(engine_id)
        if slot is None or slot.free <= 0:
            return None
        while True:
            traj_id = self.router.dequeue(slot.bucket, now)
            if traj_id is None:
                return None
            if traj_id in self.queued:
                break
        self.decisions += 1
        self.queued.discard(traj_id)
        if self.where.get(traj_id) != slot.bucket:  # stolen by an idle bucket
            self.migrations += 1
            self.where[traj_id] = slot.bucket
        slot.in_flight += 1
        return traj_id

    def tool_return(
        self, traj_id: str, signal: ToolSignal, output_tokens: int, context_tokens: int, now: float
    ) -> RouteDecision:
        """Feeds the tool return to the policy; the trajectory's next turn goes where it says."""
        self.decisions += 1
        decision = self.router.on_tool_return(traj_id, signal, output_tokens, context_tokens, now)
        if decision.bucket != self.where.get(traj_id):
            self.migrations += 1
            self.where[traj_id] = decision.bucket
        return decision

    def finish(self, traj_id: str, output_tokens: int, now: float, failed: bool) -> None:
        """Forgets the trajectory; a completed one teaches the policy its history."""
        self.where.pop(traj_id, None)
        self.queued.discard(traj_id)
        if failed:
            self.router.drop(traj_id)
        else:
            self.router.finish(traj_id, output_tokens, now)

    def running_by_bucket(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for slot in self.engines.values():
            out[slot.bucket] = out.get(slot.bucket, 0) + slot.in_flight
        return out

    def queued_by_bucket(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for traj_id in self.queued:
            bucket = self.where.get(traj_id, "")
            out[bucket] = out.get(bucket, 0) + 1
        return out


def build_dispatcher(buckets: Sequence[BucketConfig], policy: str, capacity: int) -> Dispatcher:
    """The live scheduler's queues for a run config's buckets and policy; the baseline pools every
    engine into its one bucket."""
    router = build_router(buckets, policy)
    return Dispatcher(router, capacity, pool=POOL if policy == "least_loaded" else None)
