"""The elastic hybrid pool, live: the planner moves engines into training and back by itself.

The decisions are the simulator's (`hybrid_pool.HybridPool`: join when the pool's bucket has
little to do while the trainer already has its next batch waiting; cancel pending joins and
release active workers, after `min_active_s`, when the bucket's demand stays high or the trainer
runs out of work; each condition must hold for `hold_s`). This only feeds it the live signals and
keeps its state machine in step with what the workers report on `hybrid.state`:

- demand: the scheduler's `workload.stats` (turns running on the bucket's engines plus turns
  waiting for a slot there) over the bucket's serving engines' slots (`rollout.max_batch` each);
- the trainer's backlog: `train.metrics.groups_ready` at the end of its last step, against
  `training.groups_per_step`.

A join asks for the `hybrid` role, a cancel or a release for `rollout` in the worker's bucket: the
same role changes an operator makes, fenced and recorded the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.contracts import ev
from services.common.membership import HYBRID_ROLE
from services.common.runconfig import PlanJob
from services.policy.hybrid_pool import HybridPool, HybridWorker, InvalidTransition, PoolPolicy, Role


@dataclass(frozen=True, slots=True)
class Move:
    worker_id: str
    to_role: str
    why: str


class LivePool:
    def __init__(self, job: PlanJob):
        h = job.planner.hybrid
        self.job = job
        self.enabled = h.workers > 0
        self.bucket = h.bucket or job.rollout.buckets[-1].name
        self.pool = HybridPool(
            [],
            PoolPolicy(
                join_below=h.join_below,
                release_above=h.release_above,
                hold_s=h.hold_s,
                min_active_s=h.min_active_s,
            ),
        )
        self.pool.target = h.workers
        self.queued = 0
        self.train_waiting = False

    def observe_workload(self, stats: ev.WorkloadStats) -> None:
        b = self.bucket
        self.queued = int(stats.queued_turns_by_bucket.get(b, 0) + stats.running_turns_by_bucket.get(b, 0))

    def observe_step(self, m: ev.TrainMetrics) -> None:
        if m.step > 0:
            self.train_waiting = m.groups_ready >= self.job.groups_per_step

    def observe_state(self, now: float, msg: ev.HybridState) -> None:
        """Keeps the policy's state machine where the worker says it is. A report may skip steps
        (a worker moved out and back in before it left the trainer's group is still in it, and
        says so again): the machine walks the steps in between."""
        w = self.pool.workers.get(msg.worker_id)
        if w is None:
            return
        target = {"drained": Role.FETCHING_STATE, "fetched": Role.CATCHING_UP, "joined": Role.ACTIVE}.get(
            msg.state
        )
        if target is not None and w.joining:
            order = [Role.REQUESTED, Role.FETCHING_STATE, Role.CATCHING_UP, Role.ACTIVE]
            steps = {Role.FETCHING_STATE: w.start_fetch, Role.CATCHING_UP: w.fetched, Role.ACTIVE: w.activate}
            for role in order[order.index(w.role) + 1 : order.index(target) + 1]:
                steps[role](now)
        elif msg.state == "released" and w.role == Role.RELEASING:
            w.released(now)

    def demand(self, serving: int) -> float:
        return self.queued / max(1, serving * self.job.rollout.max_batch)

    def decide(self, now: float, roles: dict[str, tuple[str, str]]) -> list[Move]:
        """`roles`: every engine's (role, bucket) in the current plan. Returns the moves to make."""
        if not self.enabled:
            return []
        self._sync(now, roles)
        serving = [w for w, (role, bucket) in roles.items() if role == "rollout" and bucket == self.bucket]
        moves: list[Move] = []
        for a in self.pool.decide(now, self.demand(len(serving)), self.train_waiting):
            w = self.pool.workers[a.worker_id]
            if a.action == "join":
                if len(serving) <= 1 or a.worker_id not in serving:
                    continue  # the bucket keeps one serving engine
                serving.remove(a.worker_id)
                w.request_join(now)
                moves.append(Move(a.worker_id, HYBRID_ROLE, "join"))
            elif a.action == "cancel":
                w.cancel(now)
                moves.append(Move(a.worker_id, "rollout", "cancel"))
            elif a.action == "release":
                w.release(now)
                moves.append(Move(a.worker_id, "rollout", "release"))
        return moves

    def _sync(self, now: float, roles: dict[str, tuple[str, str]]) -> None:
        """The pool's workers are the bucket's engines; one an operator moved, or that left the
        plan, is where the plan says."""
        for wid, (role, bucket) in roles.items():
            if bucket == self.bucket and wid not in self.pool.workers and role == "rollout":
                self.pool.workers[wid] = HybridWorker(wid, since=now)
        for wid, w in list(self.pool.workers.items()):
            role = roles.get(wid, ("", ""))[0]
            if not role:
                del self.pool.workers[wid]
            elif role == "rollout" and w.role in (Role.REQUESTED, Role.FETCHING_STATE, Role.CATCHING_UP):
                _force(w, Role.ROLLOUT, now)  # moved back by someone else before it joined
            elif role == HYBRID_ROLE and w.role == Role.ROLLOUT:
                _force(w, Role.REQUESTED, now)  # moved in by an operator: the policy may release it


def _force(w: HybridWorker, role: Role, now: float) -> None:
    try:
        if role == Role.ROLLOUT:
            w.cancel(now)
        else:
            w.request_join(now)
    except InvalidTransition:
        w.role, w.since = role, now
