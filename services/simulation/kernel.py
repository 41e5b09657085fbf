"""The simulator as its parts see it (training, KV migration, hybrid workers, re-planning): the
shared state and the few calls they make, so that each part depends on this interface and not on
`Simulator` itself."""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

from services.common.cost_model import CostModel
from services.common.synthetic import TrajectorySource
from services.policy.staleness import StalenessBound
from services.simulation.engine import Engine
from services.simulation.fleet import Members
from services.simulation.ledger import Ledger
from services.simulation.state import Group, SystemConfig, Traj


class TrainingPart(Protocol):
    busy: bool
    last_step_s: float
    lent: list[Engine]

    def maybe_train(self) -> None: ...

    def group_complete(self) -> None: ...

    def evict(self, e: Engine) -> list[str]: ...


class HostPart(Protocol):
    def busy_engines(self) -> list[Engine]: ...

    def pace(self, neighbours: int) -> float: ...


class HybridPart(Protocol):
    meters: dict[str, Any]

    def step_starts(self) -> int: ...

    def step_ends(self) -> None: ...


class KvPart(Protocol):
    def target(self, tid: str, exclude: set[str]) -> Engine | None: ...

    def move(self, tid: str, src: Engine, dst: Engine) -> None: ...


class LivesPart(Protocol):
    def admit(self, n_groups: int) -> None: ...

    def abort_hopeless(self, bound: StalenessBound) -> None: ...


class Kernel(Protocol):
    sys: SystemConfig
    cm: CostModel
    wl: TrajectorySource
    ledger: Ledger
    router: Any
    progress: Any
    n_gpus: int
    steps: int
    B: int
    """Groups per training step."""
    now: float
    version: int
    engines: dict[str, Engine]
    by_bucket: dict[str, Members]
    trajs: dict[str, Traj]
    groups: dict[int, Group]
    ready: deque[int]
    recent: deque[Traj]
    draining: set[str]
    admitted_groups: int
    dropped_groups: int
    aborted_trajectories: int
    reprefill_tokens: int
    step_ends: list[float]
    step_trajs: list[int]
    step_tokens: list[int]
    trained_staleness: list[int]
    trained_oldest_staleness: list[int]
    trained_token_staleness: list[float]
    seed: int
    spec: Any
    """The system's speculation settings (None: no drafter)."""
    siblings: Any
    latencies: list[float]
    waits: list[tuple[float, float]]
    finished: int

    @property
    def training(self) -> TrainingPart: ...

    @property
    def hybrid(self) -> HybridPart: ...

    @property
    def host(self) -> HostPart: ...

    @property
    def kvm(self) -> KvPart: ...

    @property
    def lives(self) -> LivesPart: ...

    def push(self, t: float, kind: int, payload: Any, gen: int = 0) -> None: ...

    def key(self, bucket: str) -> str: ...

    def serving(self, e: Engine) -> bool: ...

    def log(self, *decision: Any) -> None: ...

    def start_turn(self, tid: str) -> None: ...

    def fill(self, e: Engine) -> None: ...

    def wake(self, e: Engine) -> None: ...

    def load_weights(self, e: Engine) -> None: ...

    def acceptance(self, tr: Traj, e: Engine) -> float: ...
