"""The simulated cluster's engines, built from a system's allocation: its buckets' replicas, the
hybrid workers' engines (in the bucket nearest their TP) and the engines the trainer's GPUs serve
as while lent; the allocation must use exactly the cluster's GPUs."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.common.cost_model import CostModel
from services.policy.placement import LoadIndex
from services.policy.speculation import SpeculationPolicy
from services.simulation.engine import Engine
from services.simulation.state import SystemConfig


class Members:
    """The engines of one routing key, in the order they joined it, those open with a free slot
    indexed by load as the live dispatcher indexes them (`services.policy.placement`): each engine
    tells its members when its running turns change, and when it opens, closes or stops accepting
    turns (an engine waiting for weights, `draining`, stays indexed and is passed over)."""

    def __init__(self) -> None:
        self.engines: list[Engine] = []
        self.index = LoadIndex()
        self.order: dict[str, int] = {}
        self._joined = 0

    def append(self, e: Engine) -> None:
        self.engines.append(e)
        self._joined += 1
        self.order[e.engine_id] = self._joined
        e.loaded = self.loaded
        self.loaded(e)

    def remove(self, e: Engine) -> None:
        self.engines.remove(e)
        self.index.remove(e.engine_id)
        del self.order[e.engine_id]
        e.loaded = None

    def loaded(self, e: Engine) -> None:
        """`e`'s running turns changed, or whether it is open and accepting turns: a closed or
        non-accepting engine leaves the index (the caller still checks every candidate)."""
        if e.open_since is None or not e.accepting:
            self.index.remove(e.engine_id)
        else:
            self.index.set(e.engine_id, self.order[e.engine_id], e.n, e.max_seqs)

    def __iter__(self) -> Iterator[Engine]:
        return iter(self.engines)

    def __len__(self) -> int:
        return len(self.engines)

    def __contains__(self, e: object) -> bool:
        return isinstance(e, Engine) and e.engine_id in self.order


@dataclass
class Fleet:
    engines: dict[str, Engine] = field(default_factory=dict)
    by_bucket: dict[str, Members] = field(default_factory=dict)
    """Engines by routing key (`routing_key`)."""
    hybrid_ids: list[str] = field(default_factory=list)
    hybrid_bucket: str = "all"
    lent: list[Engine] = field(default_factory=list)
    """The engines the trainer's GPUs serve as while it waits for its batch."""


def routing_key(s: SystemConfig, bucket: str) -> str:
    """The routing key of a bucket ("all" when the system routes across every engine)."""
    return "all" if s.pooled_routing else bucket


def nearest_bucket(s: SystemConfig, tp: int) -> str:
    """The bucket whose TP is closest to `tp`: where an engine borrowed from training serves."""
    if not s.buckets:
        return "all"
    return min(s.buckets, key=lambda b: (abs(math.log2(b.tp) - math.log2(tp)), b.tp)).name


def build_fleet(s: SystemConfig, cm: CostModel, n_gpus: int, spec: SpeculationPolicy | None) -> Fleet:
    fleet = Fleet()

    def add(bucket: str, tp: int, hybrid: bool) -> Engine:
        eid = f"e{len(fleet.engines)}"
        e = fleet.engines[eid] = Engine(eid, bucket, tp, cm, s.max_seqs, hybrid, spec)
        fleet.by_bucket.setdefault(routing_key(s, bucket), Members()).append(e)
        return e

    for b in s.buckets:
        for _ in range(b.replicas):
            add(b.name, b.tp, hybrid=False)
    fleet.hybrid_bucket = nearest_bucket(s, s.hybrid_tp)
    if s.hybrid_gpus % s.hybrid_tp:
        raise ValueError(f"{s.name}: {s.hybrid_gpus} hybrid GPUs are not a multiple of TP {s.hybrid_tp}")
    for _ in range(s.hybrid_gpus // s.hybrid_tp):
        fleet.hybrid_ids.append(add(fleet.hybrid_bucket, s.hybrid_tp, hybrid=True).engine_id)
    if s.partial_rollout and (s.mode != "sync" or s.partial_rollout < 1.0):
        raise ValueError(
            f"{s.name}: partial rollout needs a colocated system and an over-provision ratio >= 1,"
            f" got mode {s.mode!r} and {s.partial_rollout}"
        )
    if s.lend_tp:
        if s.mode != "async" or s.train_gpus % s.lend_tp:
            raise ValueError(f"{s.name}: {s.train_gpus} training GPUs cannot lend TP{s.lend_tp} engines")
        near = nearest_bucket(s, s.lend_tp)
        for _ in range(s.train_gpus // s.lend_tp):
            fleet.lent.append(add(near, s.lend_tp, hybrid=False))
    used = s.train_gpus + sum(b.gpus for b in s.buckets) + s.hybrid_gpus
    if s.mode == "async" and used != n_gpus:
        raise ValueError(f"{s.name}: allocation uses {used} GPUs, cluster has {n_gpus}")
    return fleet
