"""C-MLFQ: a multi-level feedback queue whose levels are rollout buckets and whose feedback is causal.

Level i is bucket i (short -> TP1, medium -> TP2, long -> TP4 ...). A trajectory starts in the
shortest bucket. After every tool return its tool-return history is looked up in a
:class:`PrefixForest`; it moves only when the mean and the P90 of the predicted total point at
another bucket (both beyond the current bucket's budget, or both below it; the move goes
only as far as the more conservative of the two) and the move pays for re-prefilling its context there. Without enough tree data,
classic MLFQ demotion by attained service applies. Within a bucket, waiting turns are ordered by
attained service with an aging credit; a turn that waited longer than `aging_s` may be served by
the nearest bucket that has nothing else to do.

Pure: callers pass `now` (wall clock in a service, simulated time in the simulator).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.policy.prefix_tree import Estimate, PrefixForest, ToolSignal


@dataclass(frozen=True, slots=True)
class Bucket:
    """A rollout bucket: trajectories with a predicted total output up to `max_tokens` belong here.

    `tpot` is the relative time per output token of an engine in this bucket (lower is faster);
    it prices migrations.
    """

    name: str
    tp: int
    max_tokens: float
    tpot: float = 1.0


@dataclass(slots=True)
class CMLFQConfig:
    buckets: list[Bucket]
    use_tree: bool = True
    """False gives classic MLFQ (attained-service demotion only)."""
    min_samples: int = 8
    """Samples a global-tree node needs before it is trusted."""
    prefill_cost: float = 0.05
    """Re-prefilling one context token costs this many output-token times at the target."""
    allow_promote: bool = True
    """Let confident estimates move a trajectory back to a shorter bucket."""
    aging_s: float = 10.0
    """A turn queued this long may be served by another idle bucket (the nearest first)."""
    aging_tokens_per_s: float = 20.0
    """Within-bucket priority credit per second of waiting (attained-service tokens)."""
    queue_order: str = "admission"
    """Within-bucket order of waiting turns: 'admission' serves the earliest-admitted trajectory
    first (earliest deadline under a staleness bound: older groups must finish before they go
    stale, and the trainer needs whole groups); 'attained' is classic MLFQ (least attained service
    first, with aging), which starves the long tail that GRPO groups wait for."""
    affinity_weight: float = 0.3
    """How much load an engine that already holds the context may carry over a cold one."""


@dataclass(frozen=True, slots=True)
class RouteDecision:
    bucket: str
    migrate: bool
    reason: str
    estimate: Estimate | None = None


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the router needs to know about one engine: its id, running turns and turn slots."""

    engine_id: str
    load: int
    capacity: int


@dataclass(slots=True)
class _Traj:
    prompt_id: str
    level: int
    admitted_at: float
    tokens: int = 0
    path: list[ToolSignal] = field(default_factory=list)
    tokens_at: list[int] = field(default_factory=list)
    last_engine: str | None = None
    queued: int = 0
    migrations: int = 0


class CMLFQ:
    def __init__(self, config: CMLFQConfig, forest: PrefixForest | None = None) -> None:
        if not config.buckets:
            raise ValueError("C-MLFQ needs at least one bucket")
        self.config = config
        self.buckets = list(config.buckets)
        self.index = {b.name: i for i, b in enumerate(self.buckets)}
        self.forest = forest if forest is not None else PrefixForest()
        self.trajs: dict[str, _Traj] = {}
        self._queues: list[list[tuple[float, int, str, float]]] = [[] for _ in self.buckets]
        self._qlen = [0] * len(self.buckets)
        self._seq = itertools.count()

    def set_thresholds(self, limits: dict[str, float]) -> bool:
        """New token thresholds for the named buckets (a replanned layout; names and order stay).
        Trajectories keep their bucket until their next routing decision. True when one changed."""
        new = [Bucket(b.name, b.tp, float(limits.get(b.name, b.max_tokens)), b.tpot) for b in self.buckets]
        changed = new != self.buckets
        self.buckets = new
        return changed

    def level_for(self, total_tokens: float) -> int:
        for i, b in enumerate(self.buckets):
            if total_tokens <= b.max_tokens:
                return i
        return len(self.buckets) - 1

    def bucket_of(self, traj_id: str) -> str:
        return self.buckets[self.trajs[traj_id].level].name

    def admit(self, traj_id: str, prompt_id: str, now: float) -> str:
        """Register a new trajectory; it starts in the shortest bucket."""
        self.trajs[traj_id] = _Traj(prompt_id, 0, now)
        return self.buckets[0].name

    def on_turn_done(self, traj_id: str, tokens_so_far: int, now: float) -> RouteDecision:
        """Record attained service after a generation turn; classic MLFQ demotion when over budget."""
        t = self.trajs[traj_id]
        t.tokens = tokens_so_far
        if t.tokens > self.buckets[t.level].max_tokens and t.level < len(self.buckets) - 1:
            t.level += 1
            t.migrations += 1
            return RouteDecision(self.buckets[t.level].name, True, "demote:attained")
        return RouteDecision(self.buckets[t.level].name, False, "stay")

    def on_tool_return(
        self, traj_id: str, signal: ToolSignal, tokens_so_far: int, context_tokens: int, now: float
    ) -> RouteDecision:
        """Extend the trajectory's causal state and route its next turn."""
        t = self.trajs[traj_id]
        t.tokens = tokens_so_far
        t.path.append(signal)
        t.tokens_at.append(tokens_so_far)
        est = (
            self.forest.estimate(t.prompt_id, t.path, self.config.min_samples)
            if self.config.use_tree
            else None
        )
        if est is not None:
            lo = self.level_for(tokens_so_far + est.mean)
            hi = self.level_for(tokens_so_far + est.p90)
            if lo > t.level:
                return self._move_if_worth(t, lo, est, context_tokens)
            if hi < t.level:
                return self._move_if_worth(t, hi, est, context_tokens)
            if lo == hi:
                return RouteDecision(self.buckets[t.level].name, False, "stay:predicted", est)
        if t.tokens > self.buckets[t.level].max_tokens and t.level < len(self.buckets) - 1:
            t.level += 1
            t.migrations += 1
            return RouteDecision(self.buckets[t.level].name, True, "demote:attained", est)
        return RouteDecision(
            self.buckets[t.level].name, False, "stay:uncertain" if est else "stay:no-data", est
        )

    def _move_if_worth(self, t: _Traj, target: int, est: Estimate, context_tokens: int) -> RouteDecision:
        cur = self.buckets[t.level]
        if target == t.level:
            return RouteDecision(cur.name, False, "stay:predicted", est)
        tgt = self.buckets[target]
        reprefill = context_tokens * self.config.prefill_cost * tgt.tpot
        if target > t.level:
            saved = est.mean * (cur.tpot - tgt.tpot)
            if saved <= reprefill and cur.tpot > tgt.tpot:
                return RouteDecision(cur.name, False, "stay:not-worth", est)
        elif not self.config.allow_promote or est.mean < reprefill + context_tokens:
            return RouteDecision(cur.name, False, "stay:not-worth", est)
        t.level = target
        t.migrations += 1
        kind = "demote" if target > self.index[cur.name] else "promote"
        return RouteDecision(tgt.name, True, f"{kind}:predicted", est)

    def finish(self, traj_id: str, total_output_tokens: int, now: float) -> None:
        """Forget the trajectory and teach the trees its tool-return history."""
        t = self.trajs.pop(traj_id)
        if t.queued:
            self._qlen[t.level] -= 1
            t.queued = 0
        if self.config.use_tree:
            self.forest.observe(t.prompt_id, t.path, t.tokens_at, total_output_tokens)

    def drop(self, traj_id: str) -> None:
        """Forget an aborted trajectory without teaching anything."""
        t = self.trajs.pop(traj_id, None)
        if t is not None and t.queued:
            self._qlen[t.level] -= 1
            t.queued = 0

    def moved(self, traj_id: str, engine_id: str) -> None:
        """The trajectory's context moved to `engine_id` with its KV: later turns prefer it."""
        t = self.trajs.get(traj_id)
        if t is not None:
            t.last_engine = engine_id

    def holder(self, traj_id: str) -> str | None:
        """The engine that served the trajectory's last turn (its context is there)."""
        t = self.trajs.get(traj_id)
        return t.last_engine if t else None

    def pick_engine(self, bucket: str, engines: Sequence[EngineView], traj_id: str) -> str | None:
        """Least-loaded engine with a free slot, biased towards the engine holding the context.

        GRPO siblings of one prompt share its difficulty and so its tail; they get no pull
        towards each other's engine (packing them made one engine carry a whole group's tail).
        """
        t = self.trajs.get(traj_id)
        last = t.last_engine if t else None
        best, best_score = None, math.inf
        w = self.config.affinity_weight
        for e in engines:
            if e.load >= e.capacity:
                continue
            score = e.load / e.capacity
            if e.engine_id == last:
                score -= w
            if score < best_score:
                best, best_score = e.engine_id, score
        if best is not None and t is not None:
            t.last_engine = best
        return best

    def enqueue(self, traj_id: str, now: float) -> None:
        """Queue the trajectory's next turn in its bucket (no engine had a free slot)."""
        t = self.trajs[traj_id]
        if t.queued:
            return
        t.queued = next(self._seq) + 1
        if self.config.queue_order == "attained":
            key = t.tokens + self.config.aging_tokens_per_s * now
        else:
            key = t.admitted_at
        heapq.heappush(self._queues[t.level], (key, t.queued, traj_id, now))
        self._qlen[t.level] += 1

    def queued(self, bucket: str | None = None) -> int:
        return sum(self._qlen) if bucket is None else self._qlen[self.index[bucket]]

    def _head(self, level: int) -> tuple[float, int, str, float] | None:
        q = self._queues[level]
        while q:
            _, seq, tid, _ = q[0]
            t = self.trajs.get(tid)
            if t is not None and t.queued == seq and t.level == level:
                return q[0]
            heapq.heappop(q)
        return None

    def dequeue(self, bucket: str, now: float) -> str | None:
        """Next turn for a free slot in `bucket`: its own queue first, else the oldest aged turn of the
        nearest bucket that has one (an idle bucket steals rather than idles while others queue)."""
        level = self.index[bucket]
        head = self._head(level)
        if head is None:
            aged = None
            for nb in sorted(range(len(self.buckets)), key=lambda i: (abs(i - level), i)):
                if nb == level:
                    continue
                if aged is not None and abs(nb - level) > abs(aged[0] - level):
                    break
                h = self._head(nb)
                if (
                    h is not None
                    and now - h[3] >= self.config.aging_s
                    and (aged is None or h[3] < aged[1][3])
                ):
                    aged = (nb, h)
            if aged is None:
                return None
            nb, head = aged
            heapq.heappop(self._queues[nb])
            self._qlen[nb] -= 1
            t = self.trajs[head[2]]
            t.level = level
            t.migrations += 1
        else:
            heapq.heappop(self._queues[level])
            self._qlen[level] -= 1
            t = self.trajs[head[2]]
        t.queued = 0
        return head[2]

    def to_dict(self, max_prompts: int | None = None) -> dict[str, Any]:
        """The learned state worth persisting (the trees; of the `max_prompts` most recently used
        prompts only, when given); in-flight trajectories are not."""
        return {"forest": self.forest.to_dict(max_prompts)}

    @property
    def learned_prompts(self) -> int:
        return len(self.forest.prompts)

    def load_dict(self, data: dict[str, Any]) -> None:
        self.forest = PrefixForest.from_dict(data["forest"])
