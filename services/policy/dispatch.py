"""Scheduler-side queues over the engines, decided by a routing policy (C-MLFQ or a baseline).

The scheduler sends an engine no more turns than it decodes at once (its batch capacity, from its
load reports), and a turn only to an engine whose free KV cache holds it (`kv_view`: else the turn
would preempt another); the rest wait here, in the queue of their trajectory's bucket, ordered by
the policy. The simulator asks the same two functions. When a slot frees, the policy picks which waiting turn takes it — its own bucket's first,
else an aged turn of a neighbouring bucket (a steal, which moves the trajectory). After a tool
return the policy may move the trajectory to another bucket (a migration) for its next turn.

Pure: no I/O, time passed in; the service shell carries out what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.runconfig import BucketConfig
from services.policy.cmlfq import EngineView, RouteDecision
from services.policy.placement import LoadIndex, pick
from services.policy.prefix_tree import ToolSignal
from services.policy.routing import POOL, Router, build_router


def kv_fits(free_kv_tokens: int, need_tokens: int) -> bool:
    """Whether a turn needing `need_tokens` of KV cache (its context and what it may generate)
    fits in an engine's free KV (-1: the engine cannot tell, e.g. `hf`)."""
    return free_kv_tokens < 0 or need_tokens <= free_kv_tokens


def seqs_fit(running: int, capacity: int, seqs: int) -> bool:
    """Whether a turn of `seqs` sequences (itself and an agent call's `n - 1` alternatives) has
    that many of an engine's slots free, or the engine runs nothing (the one way a call with `n`
    above an engine's batch ever runs)."""
    return seqs <= 1 or running == 0 or capacity - running >= seqs


def kv_view(
    engine_id: str, running: int, capacity: int, free_kv_tokens: int, need_tokens: int, seqs: int = 1
) -> EngineView:
    """The engine as the router sees it for this turn: full when the turn's KV, or its sequences,
    do not fit, so the router picks another engine or queues the turn."""
    fits = kv_fits(free_kv_tokens, need_tokens) and seqs_fit(running, capacity, seqs)
    return EngineView(engine_id, running if fits else capacity, capacity)


def takes_waiting(
    free_kv_tokens: int, need_tokens: int, running: int, seqs: int = 1, capacity: int = 0
) -> bool:
    """Whether an engine with a free slot takes a waiting turn: if its KV and its sequences (of the
    engine's `capacity`) fit, or if the engine runs nothing (the one way a turn larger than any
    free cache ever runs)."""
    return running == 0 or (kv_fits(free_kv_tokens, need_tokens) and seqs_fit(running, capacity, seqs))


@dataclass
class EngineSlot:
    engine_id: str
    bucket: str
    capacity: int
    order: int
    """Its place in engine order (when it joined): a tie between equally loaded engines goes to
    the lower."""
    in_flight: int = 0
    free_kv: int = -1
    """KV-cache tokens free: the engine's last report, less what was sent it since (-1: unknown)."""

    def take(self, need_tokens: int, seqs: int = 1) -> None:
        self.in_flight += seqs
        if self.free_kv >= 0:
            self.free_kv = max(0, self.free_kv - need_tokens)

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
        """Every serving engine; change one only through the methods below, which keep the load
        indexes (`by_bucket`, `by_load`) in step."""
        self.by_bucket: dict[str, LoadIndex] = {}
        """Each bucket's engines with a free slot, by load."""
        self.by_load = LoadIndex()
        """Every engine with a free slot, by load (a bucket without engines borrows from all)."""
        self.members: dict[str, int] = {}
        """Engines per bucket."""
        self._joined = 0
        self.queued: dict[str, str] = {}
        """Waiting trajectory -> the bucket queue it waits in. Which bucket a trajectory belongs to
        has one owner, the router (`bucket_of`)."""
        self.need: dict[str, int] = {}
        """Queued trajectory -> the KV tokens its next turn needs."""
        self.seqs: dict[str, int] = {}
        """Queued trajectory -> the engine slots its next turn takes, where more than one (an
        agent's call with `n` > 1 runs `n` sequences)."""
        self.avoiding: dict[str, str] = {}
        """Queued trajectory -> the engine whose answer to its turn was refused (`place`'s
        `avoid`): that engine's free slots pass it over while another engine of its bucket serves."""
        self.migrations = 0
        self.decisions = 0

    # engines -------------------------------------------------------------------------------------

    def set_engines(self, buckets: dict[str, str]) -> None:
        """The plan's rollout engines (engine id -> bucket); in-flight counts of engines that stay
        are kept, engines that left are forgotten (their turns are re-sent by the caller)."""
        self.forget([wid for wid in self.engines if wid not in buckets])
        for wid, bucket in buckets.items():
            bucket = self.pool or bucket
            slot = self.engines.get(wid)
            if slot is None:
                self._joined += 1
                slot = self.engines[wid] = EngineSlot(wid, bucket, self.default_capacity, self._joined)
            elif slot.bucket != bucket:
                self._leave_bucket(slot)
            else:
                continue
            slot.bucket = bucket
            self.members[bucket] = self.members.get(bucket, 0) + 1
            self._indexed(slot)

    def forget(self, engine_ids: list[str]) -> None:
        """Engines that left the plan or restarted: whatever they were running is gone."""
        for wid in engine_ids:
            slot = self.engines.pop(wid, None)
            if slot is not None:
                self._leave_bucket(slot)
                self.by_load.remove(wid)

    def _leave_bucket(self, slot: EngineSlot) -> None:
        self.members[slot.bucket] -= 1
        self.by_bucket[slot.bucket].remove(slot.engine_id)

    def _indexed(self, slot: EngineSlot) -> None:
        """The slot's load changed: both indexes learn it."""
        index = self.by_bucket.get(slot.bucket)
        if index is None:
            index = self.by_bucket[slot.bucket] = LoadIndex()
        for each in (index, self.by_load):
            each.set(slot.engine_id, slot.order, slot.in_flight, slot.capacity)

    def set_capacity(self, engine_id: str, capacity: int, free_kv_tokens: int = -1) -> None:
        """The engine's load report: its batch capacity and its free KV-cache tokens now."""
        slot = self.engines.get(engine_id)
        if slot is None:
            return
        if capacity > 0 and capacity != slot.capacity:
            slot.capacity = capacity
            self._indexed(slot)
        slot.free_kv = free_kv_tokens

    def release(self, engine_id: str, seqs: int = 1) -> None:
        """A turn on the engine ended (answered, failed, lost or timed out): the `seqs` slots it
        took free."""
        slot = self.engines.get(engine_id)
        if slot is not None and slot.in_flight > 0:
            slot.in_flight = max(0, slot.in_flight - seqs)
            self._indexed(slot)

    def _take(self, slot: EngineSlot, need_tokens: int, seqs: int = 1) -> None:
        slot.take(need_tokens, seqs)
        self._indexed(slot)

    # trajectories --------------------------------------------------------------------------------

    def admit(self, traj_id: str, prompt_id: str, now: float) -> str:
        return self.router.admit(traj_id, prompt_id, now, 0)

    def bucket_of(self, traj_id: str) -> str | None:
        """The bucket the trajectory's next turn goes to (None: not admitted, or ended)."""
        try:
            return self.router.bucket_of(traj_id)
        except KeyError:
            return None

    def place(
        self, traj_id: str, now: float, avoid: str | None = None, need_tokens: int = 0, seqs: int = 1
    ) -> str | None:
        """An engine for the trajectory's next turn (its `seqs` slots taken), or None: the turn
        waits in its bucket's queue until `next_for` hands it a slot. `avoid` (an engine whose
        answer to this turn was refused) is left out while any other engine could take it; an
        engine whose free KV does not hold `need_tokens`, or that has fewer than `seqs` slots free
        while it runs anything, counts as full."""
        if traj_id in self.queued:
            return None
        self.decisions += 1
        bucket = self.router.bucket_of(traj_id)
        engine_id = self._pick(traj_id, bucket, avoid, need_tokens, seqs)
        if engine_id is None:
            self.router.enqueue(traj_id, now)
            self.queued[traj_id] = bucket
            self.need[traj_id] = need_tokens
            if seqs > 1:
                self.seqs[traj_id] = seqs
            if avoid is not None:
                self.avoiding[traj_id] = avoid
            return None
        self._take(self.engines[engine_id], need_tokens, seqs)
        return engine_id

    def _pick(self, traj_id: str, bucket: str, avoid: str | None, need_tokens: int, seqs: int) -> str | None:
        """The policy's engine among the bucket's (all engines where it has none), leaving out
        `avoid` while any other engine could serve (the bucket's, else any). A policy that places
        by load is shown two engines found through the indexes (`services.policy.placement`),
        another every engine."""
        skip = avoid if avoid is not None and len(self.engines) > (avoid in self.engines) else None
        own = self.members.get(bucket, 0)
        if own == 1 and skip in self.engines and self.engines[skip].bucket == bucket:
            own = 0  # its one engine is the one to avoid: any other engine serves
        members = self.by_bucket[bucket] if own else self.by_load

        def view(wid: str) -> EngineView:
            e = self.engines[wid]
            return kv_view(wid, e.in_flight, e.capacity, e.free_kv, need_tokens, seqs)

        if not self.router.least_loaded:
            views = [
                view(e.engine_id)
                for e in self.engines.values()
                if (not own or e.bucket == bucket) and e.engine_id != skip
            ]
            return self.router.pick_engine(bucket, views, traj_id) if views else None
        picks = pick(
            members,
            lambda wid: (
                wid != skip
                and kv_fits(self.engines[wid].free_kv, need_tokens)
                and seqs_fit(self.engines[wid].in_flight, self.engines[wid].capacity, seqs)
            ),
            self.router.holder(traj_id),
            lambda wid: (
                wid != skip and wid in self.engines and (not own or self.engines[wid].bucket == bucket)
            ),
            lambda wid: self.engines[wid].order,
        )
        return self.router.pick_engine(bucket, [view(w) for w in picks], traj_id) if picks else None

    def free_engines(self) -> list[str]:
        """The engines `next_for` may give a waiting turn now: those with a free slot, in engine
        order, and none while no turn waits (a scheduler tick then walks no engine: at 1,024
        engines a walk of all of them on every tick is what the scheduler would spend its time on)."""
        if not self.queued:
            return []
        return sorted(self.by_load.engines(), key=lambda wid: self.engines[wid].order)

    def next_for(self, engine_id: str, now: float) -> str | None:
        """The waiting trajectory the policy gives a free slot of this engine, or None."""
        slot = self.engines.get(engine_id)
        if slot is None or slot.free <= 0:
            return None
        passed: list[str] = []  # turns this engine's answer was refused for, while others serve
        others = self.members.get(slot.bucket, 0) > 1
        try:
            while True:
                traj_id = self.router.dequeue(slot.bucket, now)
                if traj_id is None:
                    return None
                if traj_id not in self.queued:
                    continue
                if others and self.avoiding.get(traj_id) == engine_id:
                    passed.append(traj_id)
                    continue
                break
        finally:
            for waiting in passed:
                self.router.enqueue(waiting, now)
        self.avoiding.pop(traj_id, None)
        self.decisions += 1
        need, seqs = self.need.get(traj_id, 0), self.seqs.get(traj_id, 1)
        if not takes_waiting(slot.free_kv, need, slot.in_flight, seqs, slot.capacity):
            self.router.enqueue(traj_id, now)  # back in its queue: this engine's KV or slots are full
            return None
        if self.queued.pop(traj_id) != slot.bucket:  # stolen by an idle bucket (the router moved it)
            self.migrations += 1
        self.need.pop(traj_id, None)
        self.seqs.pop(traj_id, None)
        self._take(slot, need, seqs)
        return traj_id

    def tool_return(
        self, traj_id: str, signal: ToolSignal, output_tokens: int, context_tokens: int, now: float
    ) -> RouteDecision:
        """Feeds the tool return to the policy; the trajectory's next turn goes where it says."""
        self.decisions += 1
        before = self.bucket_of(traj_id)
        decision = self.router.on_tool_return(traj_id, signal, output_tokens, context_tokens, now)
        if decision.bucket != before:
            self.migrations += 1
        return decision

    def finish(self, traj_id: str, output_tokens: int, now: float, failed: bool) -> None:
        """Forgets the trajectory; a completed one teaches the policy its history."""
        self.queued.pop(traj_id, None)
        self.need.pop(traj_id, None)
        self.seqs.pop(traj_id, None)
        self.avoiding.pop(traj_id, None)
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
        for bucket in self.queued.values():
            out[bucket] = out.get(bucket, 0) + 1
        return out


def build_dispatcher(buckets: Sequence[BucketConfig], policy: str, capacity: int) -> Dispatcher:
    """The live scheduler's queues for a run config's buckets and policy; the baseline pools every
    engine into its one bucket."""
    router = build_router(buckets, policy)
    return Dispatcher(router, capacity, pool=POOL if policy == "least_loaded" else None)
