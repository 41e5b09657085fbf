"""The static assignment policy: which role and bucket a newly seen worker gets.

Pure: the planner shell feeds worker hellos and expired leases, and publishes what this returns.
The search over allocations (cost model, hybrid pool) replaces it in its own issue.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

ROLE_BY_KIND = {
    "rollout-engine": "rollout",
    "trainer": "train",
    "tool-sandbox": "tool",
    "scheduler": "schedule",
}
SINGLE_ROLES = ("train", "schedule")
"""Roles one worker holds at a time: a further worker of the kind stands by (role `standby`) until
the holder's lease runs out (the planner's `promote_standby`)."""


@dataclass
class Slot:
    worker_id: str
    kind: str
    role: str
    bucket: str
    weight_sync_addr: str = ""
    tensor_parallel: int = 1
    fencing_token: int = 0


class StaticAssigner:
    def __init__(
        self, buckets: list[str], engines: dict[str, int] | None = None, tps: dict[str, int] | None = None
    ):
        """`engines`: how many rollout engines each bucket is meant to get (default one each: the
        emptiest bucket takes the next engine). `tps`: each bucket's TP, for engines whose TP is
        fixed when they start (vLLM's `tensor_parallel_size`): an engine then goes only to a
        bucket of its own TP, or, if none has it, of the nearest."""
        if not buckets:
            raise ValueError("at least one rollout bucket is needed")
        self.buckets = buckets
        self.engines = {b: (engines or {}).get(b, 1) for b in buckets}
        self.tps = tps

    def fitting(self, tp: int) -> list[str]:
        """The buckets an engine of `tp` GPUs may serve (all, unless TPs are matched)."""
        if self.tps is None:
            return self.buckets
        gap = {b: abs(math.log2(self.tps[b]) - math.log2(max(1, tp))) for b in self.buckets}
        return [b for b in self.buckets if gap[b] == min(gap.values())]

    def assign(
        self,
        worker_id: str,
        kind: str,
        preferred_bucket: str,
        current: dict[str, Slot],
        *,
        addr: str = "",
        tp: int = 1,
    ) -> Slot | None:
        """A slot for a new worker, or None for an unknown kind. One trainer holds the train role and
        one scheduler the schedule role; further ones stand by. Engines take their preferred bucket, else the one with the
        fewest for its share (the first of those): the buckets fill in proportion; with matched
        TPs, only among the buckets of the engine's TP."""
        role = ROLE_BY_KIND.get(kind)
        if role is None:
            return None
        bucket = ""
        if role in SINGLE_ROLES and any(s.role == role for s in current.values() if s.worker_id != worker_id):
            role = "standby"
        if role == "rollout":
            fitting = self.fitting(tp)
            if preferred_bucket in fitting:
                bucket = preferred_bucket
            else:
                counts = Counter(s.bucket for s in current.values() if s.role == "rollout")
                bucket = min(fitting, key=lambda b: (counts[b] / self.engines[b], self.buckets.index(b)))
        return Slot(worker_id, kind, role, bucket, addr, tp)
