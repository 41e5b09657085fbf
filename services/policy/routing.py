"""Routing policies: C-MLFQ itself and the baselines' routers, driven by the live scheduler and by
the simulator alike.

All expose the C-MLFQ call shapes (admit / on_tool_return / finish / pick_engine / enqueue /
dequeue), so the live scheduler and the simulator treat Libra and the baselines the same way:
the same objects decide in both.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from services.common.cost_model import relative_tpot
from services.common.runconfig import BucketConfig
from services.policy.cmlfq import CMLFQ, Bucket, CMLFQConfig, EngineView, RouteDecision
from services.policy.prefix_tree import ToolSignal


class Router(Protocol):
    def admit(self, traj_id: str, prompt_id: str, now: float, true_tokens: int) -> str: ...

    def on_tool_return(
        self, traj_id: str, signal: ToolSignal, tokens: int, context: int, now: float
    ) -> RouteDecision: ...

    def finish(self, traj_id: str, total: int, now: float) -> None: ...

    def drop(self, traj_id: str) -> None: ...

    least_loaded: bool
    """Whether `pick_engine` takes the engine with the lowest load, less a bonus for the one in
    `holder`, the first on a tie: then it only needs to see that engine and the least loaded one
    (`services.policy.placement`), not every engine."""

    def pick_engine(self, bucket: str, engines: Sequence[EngineView], traj_id: str) -> str | None: ...

    def holder(self, traj_id: str) -> str | None:
        """The engine the policy would like the trajectory's next turn on (its context is there)."""
        ...

    def moved(self, traj_id: str, engine_id: str) -> None:
        """The trajectory's context now lives on `engine_id` (its running turn moved there with its
        KV), so later turns should return there."""
        ...

    def enqueue(self, traj_id: str, now: float) -> None: ...

    def dequeue(self, bucket: str, now: float) -> str | None: ...

    def bucket_of(self, traj_id: str) -> str: ...

    def queued(self, bucket: str | None = None) -> int: ...

    def set_thresholds(self, limits: dict[str, float]) -> bool:
        """A replanned layout's token thresholds per bucket; True when the policy changed."""
        ...

    def to_dict(self, max_prompts: int | None = None) -> dict[str, Any]:
        """What it learned, worth keeping across a restart (C-MLFQ's prefix trees), of the
        `max_prompts` most recently used prompts only when given (the shared trees always)."""
        ...

    @property
    def learned_prompts(self) -> int:
        """How many prompts it keeps something of its own for (`to_dict`'s `max_prompts`)."""
        ...

    def load_dict(self, data: dict[str, Any]) -> None:
        """Replaces what it learned with `data`. The scheduler runs it in a thread beside its
        event loop: it builds the new state first and swaps it in with one assignment."""
        ...


POLICIES = ("cmlfq", "least_loaded")
POOL = "all"
"""The one bucket of the pooled baseline (the simulator's name for it too)."""


def build_router(buckets: Sequence[BucketConfig], policy: str) -> Router:
    """The live scheduler's router for a run config's buckets: C-MLFQ ('cmlfq', Libra's policy) or
    the homogeneous baseline ('least_loaded': one pool of every engine, least connections with
    sticky sessions, as AReaL, slime and verl's agent loop route). A bucket
    without `max_output_tokens` takes everything (the last one)."""
    limits = [float(b.max_output_tokens) if b.max_output_tokens else math.inf for b in buckets]
    if policy == "least_loaded":
        return StaticRouter([(POOL, math.inf)])
    if policy != "cmlfq":
        raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(POLICIES)}")
    core = [
        Bucket(b.name, b.tensor_parallel, hi, relative_tpot(b.tensor_parallel))
        for b, hi in zip(buckets, limits, strict=True)
    ]
    return CMLFQRouter(CMLFQ(CMLFQConfig(core)))


class CMLFQRouter:
    least_loaded = True

    def __init__(self, core: CMLFQ) -> None:
        self.core = core

    def holder(self, traj_id: str) -> str | None:
        return self.core.holder(traj_id)

    def admit(self, traj_id: str, prompt_id: str, now: float, true_tokens: int) -> str:
        return self.core.admit(traj_id, prompt_id, now)

    def on_tool_return(
        self, traj_id: str, signal: ToolSignal, tokens: int, context: int, now: float
    ) -> RouteDecision:
        return self.core.on_tool_return(traj_id, signal, tokens, context, now)

    def finish(self, traj_id: str, total: int, now: float) -> None:
        self.core.finish(traj_id, total, now)

    def drop(self, traj_id: str) -> None:
        self.core.drop(traj_id)

    def moved(self, traj_id: str, engine_id: str) -> None:
        self.core.moved(traj_id, engine_id)

    def pick_engine(self, bucket: str, engines: Sequence[EngineView], traj_id: str) -> str | None:
        return self.core.pick_engine(bucket, engines, traj_id)

    def enqueue(self, traj_id: str, now: float) -> None:
        self.core.enqueue(traj_id, now)

    def dequeue(self, bucket: str, now: float) -> str | None:
        return self.core.dequeue(bucket, now)

    def bucket_of(self, traj_id: str) -> str:
        return self.core.bucket_of(traj_id)

    def queued(self, bucket: str | None = None) -> int:
        return self.core.queued(bucket)

    def set_thresholds(self, limits: dict[str, float]) -> bool:
        return self.core.set_thresholds(limits)

    def to_dict(self, max_prompts: int | None = None) -> dict[str, Any]:
        return self.core.to_dict(max_prompts)

    @property
    def learned_prompts(self) -> int:
        return self.core.learned_prompts

    def load_dict(self, data: dict[str, Any]) -> None:
        self.core.load_dict(data)


class StaticRouter:
    """A bucket fixed at admission, FIFO queues, and least-connections or round-robin engines.

    With one bucket this is the homogeneous baseline. With `predictor_sigma` set, the bucket comes
    from a length predictor whose estimate is the true length times lognormal noise (the
    length-aware baseline). A trajectory's first turn goes to the least-loaded engine ('least') or
    the next one in turn ('rr'); with `sticky` sessions its later turns return to the engine that
    holds its context when that engine has room, as AReaL, slime and verl's agent loop route.
    """

    def __init__(
        self,
        buckets: Sequence[tuple[str, float]],
        mode: str = "least",
        predictor_sigma: float | None = None,
        seed: int = 0,
        sticky: bool = True,
    ) -> None:
        self.buckets = list(buckets)
        self.mode = mode
        self.sigma = predictor_sigma
        self.rng = random.Random(seed)
        self.sticky = sticky
        self.where: dict[str, str] = {}
        self.last: dict[str, str] = {}
        self.queues: dict[str, deque[str]] = {name: deque() for name, _ in self.buckets}
        self._rr = itertools.count()
        self.least_loaded = mode == "least"  # round robin needs every free engine, in turn

    def holder(self, traj_id: str) -> str | None:
        return self.last.get(traj_id) if self.sticky else None

    def admit(self, traj_id: str, prompt_id: str, now: float, true_tokens: int) -> str:
        bucket = self.buckets[0][0]
        if self.sigma is not None:
            guess = true_tokens * math.exp(self.rng.gauss(0.0, self.sigma))
            bucket = next((name for name, hi in self.buckets if guess <= hi), self.buckets[-1][0])
        self.where[traj_id] = bucket
        return bucket

    def on_tool_return(
        self, traj_id: str, signal: ToolSignal, tokens: int, context: int, now: float
    ) -> RouteDecision:
        return RouteDecision(self.where[traj_id], False, "static")

    def finish(self, traj_id: str, total: int, now: float) -> None:
        self.where.pop(traj_id, None)
        self.last.pop(traj_id, None)

    def drop(self, traj_id: str) -> None:
        bucket = self.where.pop(traj_id, None)
        self.last.pop(traj_id, None)
        if bucket is not None and traj_id in self.queues[bucket]:
            self.queues[bucket].remove(traj_id)

    def moved(self, traj_id: str, engine_id: str) -> None:
        if traj_id in self.where:
            self.last[traj_id] = engine_id

    def pick_engine(self, bucket: str, engines: Sequence[EngineView], traj_id: str) -> str | None:
        free = [e for e in engines if e.load < e.capacity]
        if not free:
            return None
        last = self.last.get(traj_id) if self.sticky else None
        if self.mode == "rr" and last is None:
            choice = free[next(self._rr) % len(free)].engine_id
        else:
            choice = min(
                free, key=lambda e: e.load / e.capacity - (0.3 if e.engine_id == last else 0.0)
            ).engine_id
        self.last[traj_id] = choice
        return choice

    def enqueue(self, traj_id: str, now: float) -> None:
        self.queues[self.where[traj_id]].append(traj_id)

    def dequeue(self, bucket: str, now: float) -> str | None:
        q = self.queues[bucket]
        return q.popleft() if q else None

    def bucket_of(self, traj_id: str) -> str:
        return self.where[traj_id]

    def queued(self, bucket: str | None = None) -> int:
        if bucket is None:
            return sum(len(q) for q in self.queues.values())
        return len(self.queues[bucket])

    def set_thresholds(self, limits: dict[str, float]) -> bool:
        new = [(name, float(limits.get(name, hi))) for name, hi in self.buckets]
        changed = new != self.buckets
        self.buckets = new
        return changed

    def to_dict(self, max_prompts: int | None = None) -> dict[str, Any]:
        return {}

    @property
    def learned_prompts(self) -> int:
        return 0

    def load_dict(self, data: dict[str, Any]) -> None:
        return None
