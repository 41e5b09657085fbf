"""Collects completed trajectories into complete GRPO groups and applies the staleness budget.

Pure bookkeeping: the service decides what a handle is (a JetStream message) and when to ack it.
A group is trained whole or not at all, so a stale member drops its entire group: the advantages
of the remaining members would be normalised against an incomplete group otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from services.common.contracts import ev
from services.learning.advantages import informative
from services.policy.staleness import StalenessBound, training_order

H = TypeVar("H")

Outcome = Literal["buffered", "redelivered", "stale"]


@dataclass
class Pending(Generic[H]):
    """A buffered trajectory and every delivery of it still waiting for an ack."""

    traj: ev.CompletedTrajectory
    handles: list[H]
    context: Any = None


@dataclass
class Admission(Generic[H]):
    outcome: Outcome
    released: list[Pending[H]] = field(default_factory=list)
    """Trajectories leaving the buffer without training (a dropped stale group): ack them."""


class GroupBuffer(Generic[H]):
    def __init__(self, max_staleness: int, remember_dropped: int = 10_000):
        self.bound = StalenessBound(max_staleness)
        self.groups: OrderedDict[str, dict[str, Pending[H]]] = OrderedDict()
        self._completed: dict[str, int] = {}
        """Complete groups, by the order in which each got its last member."""
        self._seq = 0
        self._dropped: OrderedDict[str, None] = OrderedDict()
        self._remember = remember_dropped

    def is_stale(self, traj: ev.CompletedTrajectory, version: int) -> bool:
        """Its oldest token (`min_policy_version`) is past the staleness bound at `version`."""
        return self.bound.is_stale(traj.min_policy_version, version)

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups.values())

    def __contains__(self, trajectory_id: str) -> bool:
        return any(trajectory_id in g for g in self.groups.values())

    def add(self, traj: ev.CompletedTrajectory, handle: H, version: int, context: Any = None) -> Admission[H]:
        group = self.groups.get(traj.group_id)
        if group is not None and traj.trajectory_id in group:
            group[traj.trajectory_id].handles.append(handle)
            return Admission("redelivered")
        pending = Pending(traj, [handle], context)
        if traj.group_id in self._dropped or self.is_stale(traj, version):
            return Admission("stale", [pending, *self.drop(traj.group_id)])
        members = self.groups.setdefault(traj.group_id, {})
        members[traj.trajectory_id] = pending
        if len(members) >= traj.group_size and traj.group_id not in self._completed:
            self._completed[traj.group_id] = self._seq
            self._seq += 1
        return Admission("buffered")

    def take(self, n: int, version: int) -> tuple[list[list[Pending[H]]], list[Pending[H]]]:
        """Removes and returns `n` complete fresh groups, or none if fewer are ready, in the order
        a step takes them (`training_order`: the oldest token first, then completion order).

        Complete groups that went stale while waiting are dropped and returned second either way.
        """
        ready: list[tuple[str, int]] = []
        stale: list[Pending[H]] = []
        for gid in sorted(self._completed, key=self._completed.__getitem__):
            oldest = [p.traj.min_policy_version for p in self.groups[gid].values()]
            if self.bound.group_is_stale(oldest, version):
                stale.extend(self.drop(gid))
                continue
            ready.append((gid, min(oldest)))
        if len(ready) < n:
            return [], stale
        return [self._pop(gid) for gid in training_order(ready)[:n]], stale

    def _pop(self, group_id: str) -> list[Pending[H]]:
        self._completed.pop(group_id, None)
        return list(self.groups.pop(group_id, {}).values())

    def filter_uninformative(self, limit: int) -> list[list[Pending[H]]]:
        """Removes up to `limit` complete groups whose rewards are all equal (zero advantage:
        nothing to learn; DAPO's dynamic sampling), oldest first, and returns them. They are
        remembered as dropped, like a stale group. Past `limit` such groups stay and are taken."""
        out: list[list[Pending[H]]] = []
        for gid, members in list(self.groups.items()):
            if len(out) >= limit:
                break
            if gid not in self._completed:
                continue
            if not informative([p.traj.reward for p in members.values()]):
                out.append(self.drop(gid))
        return out

    def waiting(self) -> list[tuple[str, int, int]]:
        """(group id, trajectories buffered, group size) of every group, oldest first."""
        out = []
        for gid, members in self.groups.items():
            first = next(iter(members.values())).traj
            out.append((gid, len(members), first.group_size))
        return out

    def drain(self) -> list[Pending[H]]:
        """Empties the buffer, e.g. to hand un-trained deliveries back on shutdown."""
        out = [p for g in self.groups.values() for p in g.values()]
        self.groups.clear()
        self._completed.clear()
        return out

    def drop(self, group_id: str) -> list[Pending[H]]:
        """Removes a group for good: later members of it are released as stale."""
        self._dropped[group_id] = None
        while len(self._dropped) > self._remember:
            self._dropped.popitem(last=False)
        return self._pop(group_id)
