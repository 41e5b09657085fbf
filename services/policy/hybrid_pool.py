"""Elastic hybrid pool: rollout workers that join training as extra data-parallel replicas.

A hybrid worker never changes the core training topology (its TP/PP mesh); it adds a DP replica
that fetches weights and its optimizer shard, catches up to the next step boundary and then
contributes gradients. Joins and releases follow an explicit state machine, and the pool decides
them with hysteresis so a worker does not bounce between roles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Role(StrEnum):
    ROLLOUT = "rollout"
    REQUESTED = "requested"
    FETCHING_STATE = "fetching_state"
    CATCHING_UP = "catching_up"
    ACTIVE = "active"
    RELEASING = "releasing"


class InvalidTransition(RuntimeError):
    pass


_ALLOWED: dict[Role, set[Role]] = {
    Role.ROLLOUT: {Role.REQUESTED},
    Role.REQUESTED: {Role.FETCHING_STATE, Role.ROLLOUT},
    Role.FETCHING_STATE: {Role.CATCHING_UP, Role.ROLLOUT},
    Role.CATCHING_UP: {Role.ACTIVE, Role.ROLLOUT},
    Role.ACTIVE: {Role.RELEASING},
    Role.RELEASING: {Role.ROLLOUT},
}


@dataclass(slots=True)
class HybridWorker:
    worker_id: str
    role: Role = Role.ROLLOUT
    since: float = 0.0
    history: list[tuple[float, Role]] = field(default_factory=list)

    def _go(self, to: Role, now: float) -> None:
        if to not in _ALLOWED[self.role]:
            raise InvalidTransition(f"{self.worker_id}: {self.role.value} -> {to.value}")
        self.role = to
        self.since = now
        self.history.append((now, to))

    def request_join(self, now: float) -> None:
        """Stop taking new rollout turns; in-flight turns drain or move."""
        self._go(Role.REQUESTED, now)

    def start_fetch(self, now: float) -> None:
        """Drained: fetch weights and the optimizer shard."""
        self._go(Role.FETCHING_STATE, now)

    def fetched(self, now: float) -> None:
        """State is here; wait for the next step boundary to enter the DP group."""
        self._go(Role.CATCHING_UP, now)

    def activate(self, now: float) -> None:
        self._go(Role.ACTIVE, now)

    def cancel(self, now: float) -> None:
        """Abort a join that has not become active; the worker serves rollout again."""
        if self.role not in (Role.REQUESTED, Role.FETCHING_STATE, Role.CATCHING_UP):
            raise InvalidTransition(f"{self.worker_id}: cannot cancel from {self.role.value}")
        self._go(Role.ROLLOUT, now)

    def release(self, now: float) -> None:
        """Leave the DP group at a step boundary."""
        self._go(Role.RELEASING, now)

    def released(self, now: float) -> None:
        self._go(Role.ROLLOUT, now)

    @property
    def joining(self) -> bool:
        return self.role in (Role.REQUESTED, Role.FETCHING_STATE, Role.CATCHING_UP)


@dataclass(slots=True)
class PoolPolicy:
    join_below: float = 0.3
    """Join training when rollout utilisation of the hybrid workers' bucket stays below this..."""
    release_above: float = 0.9
    """...and release when demand (running + queued over slots) rises above this."""
    hold_s: float = 5.0
    """A condition must persist this long before acting."""
    min_active_s: float = 30.0
    """An active worker stays at least this long in training."""


@dataclass(slots=True)
class PoolAction:
    worker_id: str
    action: str
    """'join', 'cancel' or 'release'."""


class HybridPool:
    """Decides joins and releases for a set of hybrid workers from rollout demand, with hysteresis."""

    def __init__(self, worker_ids: list[str], policy: PoolPolicy | None = None) -> None:
        self.policy = policy or PoolPolicy()
        self.workers = {w: HybridWorker(w) for w in worker_ids}
        self._low_since: float | None = None
        self._high_since: float | None = None
        self._train_idle_since: float | None = None
        self.target = len(worker_ids)
        """How many workers the planner allows in training (its hybrid pool size)."""

    def set_target(self, n: int) -> None:
        self.target = max(0, min(n, len(self.workers)))

    def in_role(self, *roles: Role) -> list[HybridWorker]:
        return [w for w in self.workers.values() if w.role in roles]

    def decide(self, now: float, rollout_demand: float, train_waiting: bool) -> list[PoolAction]:
        """One decision tick.

        `rollout_demand` is (running + queued turns) / slots of the rollout pool excluding workers
        that left it; `train_waiting` says the trainer has a batch and would use more GPUs.
        Joins need low demand and a waiting trainer; pending joins are cancelled and active
        workers released (after `min_active_s`) when demand stays high or the trainer stays
        without work, each for `hold_s`.
        """
        p = self.policy
        self._low_since = (
            (self._low_since if self._low_since is not None else now)
            if rollout_demand < p.join_below
            else None
        )
        self._high_since = (
            (self._high_since if self._high_since is not None else now)
            if rollout_demand > p.release_above
            else None
        )
        self._train_idle_since = (
            None if train_waiting else (self._train_idle_since if self._train_idle_since is not None else now)
        )
        train_idle = self._train_idle_since is not None and now - self._train_idle_since >= p.hold_s
        actions: list[PoolAction] = []
        high = self._high_since is not None and now - self._high_since >= p.hold_s
        if high or train_idle:
            # Rollout needs the workers back: every pending join is cancelled. A trainer between
            # steps only cancels joins that have not paid for their state fetch yet; fetched
            # workers wait for the next step boundary, where they enter the data-parallel group.
            pending = (Role.REQUESTED, Role.FETCHING_STATE, Role.CATCHING_UP) if high else (Role.REQUESTED,)
            for w in self.in_role(*pending):
                actions.append(PoolAction(w.worker_id, "cancel"))
            for w in self.in_role(Role.ACTIVE):
                if now - w.since >= p.min_active_s:
                    actions.append(PoolAction(w.worker_id, "release"))
        elif self._low_since is not None and now - self._low_since >= p.hold_s and train_waiting:
            busy = len(self.workers) - len(self.in_role(Role.ROLLOUT))
            for w in self.in_role(Role.ROLLOUT)[: max(0, self.target - busy)]:
                actions.append(PoolAction(w.worker_id, "join"))
        return actions
