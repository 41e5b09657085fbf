"""The elastic pool's rollout-to-training direction in the simulator: hybrid workers serve rollout
as engines until the pool policy (`services/policy/hybrid_pool.py`, the live planner's) sends them
to training, where they fetch the trainer's state and join its data-parallel group at the next step
boundary, then come back. It owns the workers and their GPU-time meters."""

from __future__ import annotations

from services.policy.hybrid_pool import HybridPool, Role
from services.simulation.engine import Engine
from services.simulation.kernel import Kernel
from services.simulation.ledger import Meter
from services.simulation.state import FETCHED


class HybridWorkers:
    def __init__(self, sim: Kernel, worker_ids: list[str], bucket: str):
        self.sim = sim
        self.bucket = bucket
        """The bucket the hybrid workers serve in while they are engines."""
        s = sim.sys
        self.pool = HybridPool(worker_ids, s.pool_policy) if worker_ids else None
        self.meters = {w: Meter(sim.ledger, s.hybrid_tp) for w in worker_ids}
        self.joins = 0

    def demand(self) -> float:
        """(running + queued turns) over the turn slots of the hybrid workers' bucket."""
        sim = self.sim
        key = sim.key(self.bucket)
        engines = [e for e in sim.by_bucket.get(key, []) if e.accepting and e.open_since is not None]
        running = sum(e.n for e in engines)
        waiting = sim.router.queued(key)
        return (running + waiting) / max(1, 16 * len(engines))

    def tick(self) -> None:
        sim = self.sim
        assert self.pool is not None
        waiting = sim.training.busy or len(sim.ready) >= sim.B
        for a in self.pool.decide(sim.now, self.demand(), waiting):
            w = self.pool.workers[a.worker_id]
            e = sim.engines[a.worker_id]
            if a.action == "join":
                w.request_join(sim.now)
                e.accepting = False
                if e.n == 0:
                    self.start_fetch(a.worker_id)
            elif a.action == "cancel":
                if w.role != Role.REQUESTED:
                    self.meters[w.worker_id].set(None, sim.now)
                    self._reopen(e)
                w.cancel(sim.now)
                e.accepting = True
                sim.fill(e)
                sim.wake(e)
            elif a.action == "release":
                w.release(sim.now)
                if not sim.training.busy:
                    self._released(w.worker_id)

    def engine_idle(self, eid: str) -> None:
        """An engine ran out of turns: a worker waiting to leave for training goes now."""
        if self.pool is None:
            return
        w = self.pool.workers.get(eid)
        if w is not None and w.role == Role.REQUESTED:
            self.start_fetch(eid)

    def start_fetch(self, wid: str) -> None:
        sim = self.sim
        assert self.pool is not None
        w = self.pool.workers[wid]
        e = sim.engines[wid]
        e.close(sim.now)
        e.drop_cache()
        w.start_fetch(sim.now)
        self.meters[wid].set("switch", sim.now)
        sim.push(sim.now + sim.cm.state_fetch_s(sim.sys.train_gpus), FETCHED, wid)

    def on_fetched(self, wid: str) -> None:
        sim = self.sim
        assert self.pool is not None
        w = self.pool.workers[wid]
        if w.role != Role.FETCHING_STATE:
            return
        w.fetched(sim.now)
        self.meters[wid].set("train_idle", sim.now)
        if not sim.training.busy:
            sim.training.maybe_train()

    def step_starts(self) -> int:
        """A training step starts: workers that caught up join it (only at a step boundary).
        Returns the GPUs the hybrid workers add to it."""
        if self.pool is None:
            return 0
        sim = self.sim
        extra = 0
        for w in self.pool.in_role(Role.CATCHING_UP):
            w.activate(sim.now)
            self.joins += 1
        for w in self.pool.in_role(Role.ACTIVE):
            extra += sim.sys.hybrid_tp
            self.meters[w.worker_id].set("train_busy", sim.now)
        return extra

    def step_ends(self) -> None:
        """A training step ended: active workers idle, releasing ones go back to rollout."""
        if self.pool is None:
            return
        for w in self.pool.in_role(Role.ACTIVE):
            self.meters[w.worker_id].set("train_idle", self.sim.now)
        for w in self.pool.in_role(Role.RELEASING):
            self._released(w.worker_id)

    def training_gpus(self) -> int:
        """GPUs of the hybrid workers training now (the timeline's count)."""
        return sum(m.gpus for m in self.meters.values() if m.state == "train_busy")

    def close(self, end: float) -> None:
        for m in self.meters.values():
            m.set(None, end)

    def _reopen(self, e: Engine) -> None:
        """A hybrid worker serves rollout again: it reloads the engine with the current weights."""
        sim = self.sim
        e.open(sim.now)
        e.load_weights(sim.now, sim.cm.engine_load_s(e.tp), sim.version)

    def _released(self, wid: str) -> None:
        sim = self.sim
        assert self.pool is not None
        w = self.pool.workers[wid]
        w.released(sim.now)
        self.meters[wid].set(None, sim.now)
        e = sim.engines[wid]
        e.accepting = True
        self._reopen(e)
        sim.fill(e)
        sim.wake(e)
