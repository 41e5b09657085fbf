"""Discrete-event simulator of an agentic RL run: rollout engines, tools, trainer, planner, pool.

One heap of events (engine turn completions, tool returns, training steps, weight syncs, hybrid
pool transitions, ticks). Engines aggregate decode iterations (see :mod:`services.simulation.engine`), so
the event count scales with turns, not tokens. Routing, planning and pool decisions come from the
same core modules the services use. `Simulator` is the event loop and the rollout side (turns on
engines, tools, routing); the training side (`training.py`), KV migration (`kv_migration.py`),
hybrid workers (`hybrid.py`) and re-planning (`replanning.py`) are its parts.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Any

from services.common.cost_model import CostModel
from services.common.synthetic import TrajectorySource
from services.policy.dispatch import kv_fits, kv_view, takes_waiting
from services.policy.placement import pick
from services.simulation.drafting import DRAFTERS
from services.simulation.engine import Engine, Request
from services.simulation.fleet import Members, build_fleet, routing_key
from services.simulation.host import SharedHost
from services.simulation.hybrid import HybridWorkers
from services.simulation.kv_migration import KvMigration
from services.simulation.ledger import Ledger, book_engine
from services.simulation.replanning import Replanner
from services.simulation.siblings import SiblingReach
from services.simulation.state import (
    ENGINE,
    FETCHED,
    KV_RESERVE,
    MOVED,
    STALL_S,
    SYNC_DONE,
    TICK,
    TOOL,
    TRAIN_DONE,
    Group,
    SystemConfig,
    Traj,
)
from services.simulation.training import Training
from services.simulation.trajectories import Trajectories


class Simulator:
    def __init__(
        self,
        system: SystemConfig,
        workload: TrajectorySource,
        cm: CostModel,
        n_gpus: int,
        steps: int,
        seed: int = 0,
        tick_s: float = 2.0,
        progress: Any = None,
    ) -> None:
        self.sys = system
        self.wl = workload
        self.cm = cm
        self.n_gpus = n_gpus
        self.steps = steps
        self.seed = seed
        self.tick_s = tick_s
        self.progress = progress
        self.B = workload.prompts_per_step
        self.router = system.router
        self.now = 0.0
        self.events: list[tuple[float, int, int, Any, int]] = []
        self._seq = 0
        self.n_events = 0
        self.ledger = Ledger()
        self.engines: dict[str, Engine] = {}
        self.by_bucket: dict[str, Members] = {}
        self.trajs: dict[str, Traj] = {}
        self.groups: dict[int, Group] = {}
        self.ready: deque[int] = deque()
        """Complete groups waiting for a training step, in completion order (re-ordered as a
        step takes them: `training_order`)."""
        self.decisions: list[tuple[Any, ...]] | None = None
        """When a list: every admission, completion, abort, drop and training step, in order, to
        replay through the live feed and trainer (`tests/unit/test_staleness_agreement.py`)."""
        self.admitted_groups = 0
        self.version = 0
        self.step_ends: list[float] = []
        self.step_trajs: list[int] = []
        self.step_tokens: list[int] = []
        self.latencies: list[float] = []
        self.waits: list[tuple[float, float]] = []
        """Per finished trajectory: seconds its turns waited in bucket queues, and in tools."""
        self.finished = 0
        self.dropped_groups = 0
        self.aborted_trajectories = 0
        self.trained_staleness: list[int] = []
        """Per trained group: the trainer's version minus the version that admitted the group."""
        self.trained_oldest_staleness: list[int] = []
        """Per trained group: the trainer's version minus its oldest token's version (what the
        staleness bound judges: never above it)."""
        self.trained_token_staleness: list[float] = []
        """Per trained group: the trainer's version minus the mean version its tokens were
        generated under (a turn that spans a weight update counts each segment at its version)."""
        self.draining: set[str] = set()
        self.migrations = 0
        self.reprefill_tokens = 0
        self.timeline: list[tuple[float, int, int, int]] = []
        self.recent: deque[Traj] = deque(maxlen=4 * self.B * workload.group_size)
        """The most recently admitted trajectories: the re-fit's length sample (`length_sample`)."""
        self.kvm = KvMigration(self)
        self.lives = Trajectories(self)
        self.replanner = Replanner(self, system.replan) if system.replan is not None else None
        self._build()

    def push(self, t: float, kind: int, payload: Any, gen: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload, gen))

    def _build(self) -> None:
        s = self.sys
        if s.drafter not in DRAFTERS:
            raise ValueError(f"{s.name}: unknown drafter {s.drafter!r}; known: {', '.join(DRAFTERS)}")
        self.spec = s.speculation if s.drafter != "none" and s.speculation.enabled else None
        self.siblings = SiblingReach(s.drafter, s.acceptance)
        fleet = build_fleet(s, self.cm, self.n_gpus, self.spec)
        self.engines, self.by_bucket = fleet.engines, fleet.by_bucket
        self.hybrid = HybridWorkers(self, fleet.hybrid_ids, fleet.hybrid_bucket)
        self.training = Training(self, fleet.lent)
        self.host = SharedHost(self, self.cm.calib.host_sharing, s.trainer_on_host)

    def key(self, bucket: str) -> str:
        """The routing key of a bucket ("all" when the system routes across every engine)."""
        return routing_key(self.sys, bucket)

    # ---- rollout ------------------------------------------------------------------------------

    def log(self, *decision: Any) -> None:
        if self.decisions is not None:
            self.decisions.append(decision)

    def start_turn(self, tid: str) -> None:
        tr = self.trajs[tid]
        key = self.key(tr.bucket)
        reserve = tr.spec.turns[tr.turn].output_tokens + KV_RESERVE
        need = tr.context + reserve
        views = [
            kv_view(e.engine_id, e.n, e.max_seqs, e.free_kv(), need) for e in self._candidates(key, tid, need)
        ]
        eid = self.router.pick_engine(key, views, tid) if views else None
        if eid is None:
            self.router.enqueue(tid, self.now)
            if tr.queued_at < 0:
                tr.queued_at = self.now
            return
        self._run_turn(tid, self.engines[eid])

    def _candidates(self, key: str, tid: str, need: int) -> list[Engine]:
        """The serving engines of `key` the policy chooses among, as the live dispatcher shows
        them: a policy that places by load sees the least loaded engine that fits the turn and
        the one holding its context (`services.policy.placement`), another every engine."""
        members = self.by_bucket.get(key)
        if members is None:
            return []
        if not self.router.least_loaded:
            return [e for e in members if self.serving(e)]
        engines = self.engines

        def takes(eid: str) -> bool:
            e = engines[eid]
            return self.serving(e) and kv_fits(e.free_kv(), need)

        def may_hold(eid: str) -> bool:
            return eid in members.order and self.serving(engines[eid])

        picks = pick(members.index, takes, self.router.holder(tid), may_hold, members.order.__getitem__)
        return [engines[eid] for eid in picks]

    def serving(self, e: Engine) -> bool:
        return e.accepting and e.open_since is not None and e.engine_id not in self.draining

    def _run_turn(self, tid: str, e: Engine) -> None:
        tr = self.trajs[tid]
        if tr.queued_at >= 0:
            tr.queue_s += self.now - tr.queued_at
            tr.queued_at = -1.0
        turn = tr.spec.turns[tr.turn]
        new = tr.payload()
        context = tr.context + tr.partial
        if tr.partial:
            prefill = context  # its engine went back to training mid-turn: nothing is cached
            self.reprefill_tokens += context
        elif tr.engine == e.engine_id and e.prefix.take(tid):
            prefill = context - self._whole_blocks(context - new)
        else:
            if tr.engine is not None and tr.engine != e.engine_id:
                old = self.engines[tr.engine]
                old.prefix.forget(tid)
                self.migrations += old.bucket != e.bucket
            cached = self._whole_blocks(tr.spec.prompt_tokens) if tr.spec.prompt_id in e.prefix.prompts else 0
            prefill = context - cached
            if tr.turn > 0:
                self.reprefill_tokens += prefill - new
        tr.engine = e.engine_id
        e.join(
            Request(tid, turn.output_tokens - tr.partial, context, acceptance=self.acceptance(tr, e)),
            self.now,
            max(1, prefill),
            tr.spec.prompt_id,
        )
        self.wake(e)

    def _whole_blocks(self, tokens: int) -> int:
        """What of a cached prefix an engine finds: its whole KV blocks (`kv_block_tokens`)."""
        block = self.cm.calib.kv_block_tokens
        return tokens - tokens % block

    def load_weights(self, e: Engine) -> None:
        """The engine takes the newest weights (see :meth:`Engine.load_weights`)."""
        self.draining.discard(e.engine_id)
        for req, done in e.running():
            tr = self.trajs[req.traj_id]
            tr.attribute(tr.partial + int(done), e.version)
        self.reprefill_tokens += e.reprefill_tokens()
        share = self.sys.push_share if e.version > 0 else 1.0  # an engine's first push is whole
        e.load_weights(self.now, self.cm.engine_load_s(e.tp, share, self.sys.push_copies), self.version)

    def acceptance(self, tr: Traj, e: Engine) -> float:
        """Per-token acceptance of this turn's drafter: what it can read of the group's same turn."""
        return (
            0.0
            if self.spec is None
            else self.siblings.acceptance(self.groups[tr.group], tr.turn, e.engine_id)
        )

    def wake(self, e: Engine) -> None:
        e.gen += 1
        t = e.next_event()
        if t is not None:
            self.push(t, ENGINE, e.engine_id, e.gen)

    def _on_engine(self, eid: str, gen: int) -> None:
        e = self.engines[eid]
        if gen != e.gen:
            return
        for req in e.pop_done(self.now):
            self.lives.turn_done(req)
        if e.n == 0 and eid in self.draining:
            self.load_weights(e)
        self.fill(e)
        self.wake(e)
        if not e.accepting and e.n == 0:
            self.hybrid.engine_idle(eid)

    def fill(self, e: Engine) -> None:
        if not self.serving(e):
            return
        key = self.key(e.bucket)
        while e.n < e.max_seqs:
            tid = self.router.dequeue(key, self.now)
            if tid is None:
                return
            tr = self.trajs[tid]
            tr.bucket = self.router.bucket_of(tid) if not self.sys.pooled_routing else tr.bucket
            need = tr.context + tr.spec.turns[tr.turn].output_tokens + KV_RESERVE
            if not takes_waiting(e.free_kv(), need, e.n):
                self.router.enqueue(tid, self.now)
                return
            self._run_turn(tid, e)

    # ---- ticks and the main loop --------------------------------------------------------------

    def _on_tick(self) -> None:
        self._sample_timeline()
        if self.router.queued():
            # Engines with nothing running get no events of their own; let them pull aged turns.
            for e in self.engines.values():
                if e.n == 0 and self.serving(e):
                    self.fill(e)
                    self.wake(e)
        if self.sys.kv_migration:
            self.kvm.consolidate()
        if self.hybrid.pool is not None and self.sys.mode == "async":
            self.hybrid.tick()
        if self.replanner is not None:
            self.replanner.tick()
        if self.version < self.steps:
            self.push(self.now + self.tick_s, TICK, None)

    def _sample_timeline(self) -> None:
        roll = sum(e.tp for e in self.engines.values() if e.open_since is not None and e.n > 0)
        meter = self.training.meter
        train = meter.gpus if meter.state == "train_busy" else 0
        train += self.hybrid.training_gpus()
        switch = meter.gpus if meter.state in ("switch", "train_sync") else 0
        self.timeline.append((self.now, roll, train, switch))

    def run(self) -> dict[str, Any]:
        for e in self.engines.values():
            e.open(0.0)
        self.training.start()
        self.push(0.0, TICK, None)
        events = self.events
        progress_at = 0.0
        while events and self.version < self.steps:
            t, _, kind, payload, gen = heapq.heappop(events)
            self.now = t
            self.n_events += 1
            if kind != TICK:
                progress_at = t
            elif t - progress_at > STALL_S:
                break
            if kind == ENGINE:
                self._on_engine(payload, gen)
            elif kind == TOOL:
                self.lives.on_tool(payload)
            elif kind == TRAIN_DONE:
                self.training.on_done(gen)
            elif kind == SYNC_DONE:
                self.training.on_sync_done(payload)
            elif kind == FETCHED:
                self.hybrid.on_fetched(payload)
            elif kind == TICK:
                self._on_tick()
            elif kind == MOVED:
                self.kvm.on_moved(payload)
            self.host.share()
        if self.version < self.steps:
            raise RuntimeError(f"{self.sys.name}: simulation stalled at step {self.version}")
        return self._close()

    def _close(self) -> dict[str, Any]:
        end = self.now
        for e in self.engines.values():
            if e.open_since is not None:
                e.close(end)
            book_engine(self.ledger, e)
        if self.replanner is not None:
            self.replanner.close(end)
        self.training.meter.set(None, end)
        self.hybrid.close(end)
        return {"end": end}
