"""Discrete-event simulator of an agentic RL run: rollout engines, tools, trainer, planner, pool.

One heap of events (engine turn completions, tool returns, training steps, weight syncs, hybrid
pool transitions, ticks). Engines aggregate decode iterations (see :mod:`tools.sim.engine`), so
the event count scales with turns, not tokens. Routing, planning and pool decisions come from the
same core modules the services use.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.cost_model import CostModel
from services.common.synthetic import TrajectorySpec, Workload
from services.planner.hybrid_pool import HybridPool, PoolPolicy, Role
from services.planner.replan import ReplanPolicy, ReplanSignals, length_sample, refit_thresholds
from services.planner.search import BucketPlan, SearchOptions, WorkloadStats
from services.rollout_engine.speculation import SpeculationPolicy
from services.scheduler.cmlfq import EngineView
from services.scheduler.consolidation import EngineSlots, consolidation_moves
from tools.sim.drafting import DRAFTERS, AcceptanceModel
from tools.sim.engine import Engine, Request
from tools.sim.ledger import Ledger, Meter

ENGINE, TOOL, TRAIN_DONE, SYNC_DONE, FETCHED, TICK, MOVED = range(7)
KV_RESERVE = 2048
STALL_S = 3600.0
"""Simulated seconds without any event but ticks after which a run is declared stuck."""


@dataclass(slots=True)
class SystemConfig:
    """One system under test: its allocation, pipeline and routing policy."""

    name: str
    mode: str
    """'sync' (colocated: all GPUs alternate stages) or 'async' (disaggregated, bounded staleness)."""
    train_gpus: int
    train_tp: int
    buckets: list[BucketPlan]
    router: Any
    hybrid_gpus: int = 0
    hybrid_tp: int = 1
    """GPUs per hybrid worker: one rollout engine of this TP, or one data-parallel training replica."""
    staleness: int = 1
    max_seqs: int = 128
    pool_policy: PoolPolicy | None = None
    replan: ReplanPolicy | None = None
    pooled_routing: bool = False
    """Route across all engines as one bucket (the no-C-MLFQ ablation)."""
    lend_tp: int = 0
    """When > 0, the training GPUs serve rollout as engines of this TP while the trainer waits for
    a batch, and go back to training when it starts (Libra's elastic pool in the trainer-to-rollout
    direction). Each move costs a colocated role switch; turns running on them move elsewhere."""
    job_groups: int | None = None
    """Groups the job launches in all, besides replacements for dropped ones, as the live task
    feed does (`steps * groups_per_step`): the last steps then wait for the groups already out
    instead of the first of extra ones to finish. None: no end in sight (a long run's steady
    state, the default for comparing systems)."""
    update_mode: str = "recompute"
    """How engines take new weights: 'recompute' interrupts running turns, loads, and re-prefills
    their context under the new weights (AReaL's interruptible generation); 'drain' stops starting
    turns, lets running turns finish on the old weights, then loads."""
    drafter: str = "none"
    """Speculative decoding's draft source: 'none', 'ngram', 'suffix' or 'group'
    (:mod:`tools.sim.drafting`)."""
    speculation: SpeculationPolicy = field(default_factory=lambda: SpeculationPolicy("off"))
    """How many drafted tokens a sequence verifies per step (fixed or adaptive)."""
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    kv_migration: bool = False
    """Running turns move with their KV cache (RDMA, no re-prefill) from busy engines to idle ones
    when nothing is queued, and off engines taken back for training (Seer's divided rollout)."""
    partial_rollout: float = 0.0
    """Colocated ('sync') systems only, 0 for off: APRIL's active partial rollout (arXiv 2509.18521;
    slime's `--partial-rollout` with `--over-sampling-batch-size`). Rollout keeps this many times
    the batch's groups in flight, training starts at the first B complete groups, and the turns
    still running then stop, keep the tokens they generated and continue in the next rollout phase
    under the new weights (re-prefilling their context) before new groups start. The staleness
    bound holds as for the asynchronous systems: at most (η + 1)·B groups in flight (AReaL's
    admission rule), and a group that could no longer be trained within it is dropped and
    replaced."""
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Traj:
    spec: TrajectorySpec
    group: int
    admitted: float
    bucket: str
    version: int = 0
    turn: int = 0
    partial: int = 0
    """Tokens of the current turn generated on an engine that was taken back for training."""
    attributed: int = 0
    """Tokens of the current turn already counted under the policy version that generated them."""
    gen_tokens: int = 0
    version_tokens: float = 0.0
    """Sum over generated tokens of the policy version that generated each (segment accounting)."""
    tokens: int = 0
    context: int = 0
    engine: str | None = None
    in_tool: bool = False
    queued_at: float = -1.0
    """When its pending turn entered a bucket queue (-1: not queued)."""
    queue_s: float = 0.0
    tool_s: float = 0.0
    finished: bool = False


@dataclass(slots=True)
class _Group:
    version: int
    left: int
    trajs: list[str]
    tokens: int = 0
    max_context: int = 0
    gen_tokens: int = 0
    version_tokens: float = 0.0
    turns_done: dict[int, int] = field(default_factory=dict)
    """Turn index -> samples of the group that finished that turn (the group drafter's references)."""
    turns_done_on: dict[tuple[str, int], int] = field(default_factory=dict)
    """(engine, turn index) -> samples that finished that turn there (a per-engine suffix cache)."""


class Simulator:
    def __init__(
        self,
        system: SystemConfig,
        workload: Workload,
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
        self.rng = random.Random(seed)
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
        self.by_bucket: dict[str, list[Engine]] = {}
        self.trajs: dict[str, _Traj] = {}
        self.groups: dict[int, _Group] = {}
        self.ready: deque[int] = deque()
        self.admitted_groups = 0
        self.version = 0
        self.training = False
        self.syncing = False
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
        self.trained_token_staleness: list[float] = []
        """Per trained group: the trainer's version minus the mean version its tokens were
        generated under (a turn that spans a weight update counts each segment at its version)."""
        self.draining: set[str] = set()
        self.migrations = 0
        self.reprefill_tokens = 0
        self.kv_moves = 0
        self.kv_sent_tokens = 0
        """KV tokens that left an engine with a moved sequence; each arrives (`kv_received_tokens`)
        after the transfer time, whether it is then used or re-prefilled."""
        self.kv_received_tokens = 0
        self.kv_fallbacks = 0
        """Moved sequences whose destination was full or had newer weights on arrival."""
        self.inbound: dict[str, int] = {}
        self.timeline: list[tuple[float, int, int, int]] = []
        self.replans: list[dict[str, Any]] = []
        self.recent: deque[_Traj] = deque(maxlen=4 * self.B * workload.group_size)
        """The most recently admitted trajectories: the re-fit's length sample (`length_sample`)."""
        self._last_train_s = 0.0
        self.train_durations: list[float] = []
        self.train_gen = 0
        self.hybrid_joins = 0
        self._build()

    def _push(self, t: float, kind: int, payload: Any, gen: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload, gen))

    def _build(self) -> None:
        s = self.sys
        if s.drafter not in DRAFTERS:
            raise ValueError(f"{s.name}: unknown drafter {s.drafter!r}; known: {', '.join(DRAFTERS)}")
        self.spec = s.speculation if s.drafter != "none" and s.speculation.enabled else None
        i = 0
        for b in s.buckets:
            for _ in range(b.replicas):
                self._add_engine(f"e{i}", b.name, b.tp, hybrid=False)
                i += 1
        self.hybrid_bucket = self._nearest_bucket(s.hybrid_tp)
        if s.hybrid_gpus % s.hybrid_tp:
            raise ValueError(f"{s.name}: {s.hybrid_gpus} hybrid GPUs are not a multiple of TP {s.hybrid_tp}")
        hybrid_ids = []
        for _ in range(s.hybrid_gpus // s.hybrid_tp):
            self._add_engine(f"e{i}", self.hybrid_bucket, s.hybrid_tp, hybrid=True)
            hybrid_ids.append(f"e{i}")
            i += 1
        self.pool = HybridPool(hybrid_ids, s.pool_policy) if hybrid_ids else None
        if s.partial_rollout and (s.mode != "sync" or s.partial_rollout < 1.0):
            raise ValueError(
                f"{s.name}: partial rollout needs a colocated system and an over-provision ratio >= 1,"
                f" got mode {s.mode!r} and {s.partial_rollout}"
            )
        self.bounded = s.mode == "async" or s.partial_rollout > 0
        """Whether groups can be trained after a weight update, so the staleness bound applies."""
        self.carried: list[str] = []
        """Trajectories whose running turn stopped when a partial-rollout step started training."""
        self.lent: list[Engine] = []
        self.lend_state = "training"
        if s.lend_tp:
            if s.mode != "async" or s.train_gpus % s.lend_tp:
                raise ValueError(f"{s.name}: {s.train_gpus} training GPUs cannot lend TP{s.lend_tp} engines")
            near = self._nearest_bucket(s.lend_tp)
            for _ in range(s.train_gpus // s.lend_tp):
                self._add_engine(f"e{i}", near, s.lend_tp, hybrid=False)
                self.lent.append(self.engines[f"e{i}"])
                i += 1
        self.worker_meters = {w: Meter(self.ledger, s.hybrid_tp) for w in hybrid_ids}
        self.trainer = Meter(self.ledger, s.train_gpus if s.mode == "async" else self.n_gpus)
        used = s.train_gpus + sum(b.gpus for b in s.buckets) + s.hybrid_gpus if s.mode == "async" else None
        if s.mode == "async" and used != self.n_gpus:
            raise ValueError(f"{s.name}: allocation uses {used} GPUs, cluster has {self.n_gpus}")

    def _nearest_bucket(self, tp: int) -> str:
        """The bucket whose TP is closest to `tp`: where an engine borrowed from training serves."""
        if not self.sys.buckets:
            return "all"
        return min(self.sys.buckets, key=lambda b: (abs(math.log2(b.tp) - math.log2(tp)), b.tp)).name

    def _add_engine(self, eid: str, bucket: str, tp: int, hybrid: bool) -> None:
        e = Engine(eid, bucket, tp, self.cm, self.sys.max_seqs, hybrid, self.spec)
        self.engines[eid] = e
        key = "all" if self.sys.pooled_routing else bucket
        self.by_bucket.setdefault(key, []).append(e)

    def _key(self, bucket: str) -> str:
        return "all" if self.sys.pooled_routing else bucket

    # ---- rollout ------------------------------------------------------------------------------

    def _admit(self, n_groups: int) -> None:
        for _ in range(n_groups):
            gid = self.admitted_groups
            self.admitted_groups += 1
            pid = f"p{gid}"
            # Common random numbers: group k is the same draw in every system, whatever the timing.
            specs = self.wl.group_for(self.seed, gid, self.version, pid)
            g = _Group(self.version, len(specs), [])
            self.groups[gid] = g
            for k, spec in enumerate(specs):
                tid = f"{pid}s{k}"
                bucket = self.router.admit(tid, pid, self.now, spec.output_tokens)
                tr = _Traj(spec, gid, self.now, bucket, self.version, context=spec.prompt_tokens)
                self.recent.append(tr)
                self.trajs[tid] = tr
                g.trajs.append(tid)
                self._start_turn(tid)

    def _candidates(self, key: str, tr: _Traj) -> list[Engine]:
        pool = self.by_bucket.get(key, [])
        n = len(pool)
        if n <= 24:
            return pool
        # Power-of-d choices: a few random engines (plus the one holding the context) is as good
        # as scanning the whole bucket for least-load routing, and keeps large clusters cheap.
        r = self.rng.random
        cands = [pool[int(r() * n)] for _ in range(8)]
        if tr.engine is not None:
            last = self.engines[tr.engine]
            if self._key(last.bucket) == key and last not in cands:
                cands.append(last)
        return cands

    def _start_turn(self, tid: str) -> None:
        tr = self.trajs[tid]
        key = self._key(tr.bucket)
        reserve = tr.spec.turns[tr.turn].output_tokens + KV_RESERVE
        views = [
            EngineView(e.engine_id, e.n if e.fits(tr.context, reserve) else e.max_seqs, e.max_seqs)
            for e in self._candidates(key, tr)
            if self._serving(e)
        ]
        eid = self.router.pick_engine(key, views, tid) if views else None
        if eid is None:
            self.router.enqueue(tid, self.now)
            if tr.queued_at < 0:
                tr.queued_at = self.now
            return
        self._run_turn(tid, self.engines[eid])

    def _serving(self, e: Engine) -> bool:
        return e.accepting and e.open_since is not None and e.engine_id not in self.draining

    def _run_turn(self, tid: str, e: Engine) -> None:
        tr = self.trajs[tid]
        if tr.queued_at >= 0:
            tr.queue_s += self.now - tr.queued_at
            tr.queued_at = -1.0
        turn = tr.spec.turns[tr.turn]
        new = turn_payload(tr)
        context = tr.context + tr.partial
        if tr.partial:
            prefill = context  # its engine went back to training mid-turn: nothing is cached
            self.reprefill_tokens += context
        elif tr.engine == e.engine_id and e.take_cached(tid):
            prefill = new
        else:
            if tr.engine is not None and tr.engine != e.engine_id:
                old = self.engines[tr.engine]
                old.forget(tid)
                self.migrations += old.bucket != e.bucket
            cached = tr.spec.prompt_tokens if tr.spec.prompt_id in e.prompts else 0
            prefill = context - cached
            if tr.turn > 0:
                self.reprefill_tokens += prefill - new
        tr.engine = e.engine_id
        e.join(
            Request(tid, turn.output_tokens - tr.partial, context, acceptance=self._acceptance(tr, e)),
            self.now,
            max(1, prefill),
            tr.spec.prompt_id,
        )
        self._wake(e)

    @staticmethod
    def _attribute(tr: _Traj, upto: int, version: int) -> None:
        """Count the current turn's tokens generated since the last count, up to `upto`, as
        generated by policy `version`."""
        new = upto - tr.attributed
        if new > 0:
            tr.gen_tokens += new
            tr.version_tokens += new * version
            tr.attributed = upto

    def _acceptance(self, tr: _Traj, e: Engine) -> float:
        """Per-token acceptance of this turn's drafter: what it can read of the group's same turn."""
        if self.spec is None:
            return 0.0
        drafter = self.sys.drafter
        g = self.groups[tr.group]
        if drafter == "group":
            siblings = g.turns_done.get(tr.turn, 0)
        elif drafter == "suffix":
            siblings = g.turns_done_on.get((e.engine_id, tr.turn), 0)
        else:
            siblings = 0
        return self.sys.acceptance.acceptance(siblings)

    def _wake(self, e: Engine) -> None:
        e.gen += 1
        t = e.next_event()
        if t is not None:
            self._push(t, ENGINE, e.engine_id, e.gen)

    def _on_engine(self, eid: str, gen: int) -> None:
        e = self.engines[eid]
        if gen != e.gen:
            return
        for req in e.pop_done(self.now):
            self._turn_done(req)
        if e.n == 0 and eid in self.draining:
            self._load(e)
        self._fill(e)
        self._wake(e)
        if not e.accepting and e.n == 0 and self.pool is not None:
            w = self.pool.workers.get(eid)
            if w is not None and w.role == Role.REQUESTED:
                self._start_fetch(eid)

    def _fill(self, e: Engine) -> None:
        if not self._serving(e):
            return
        key = self._key(e.bucket)
        while e.n < e.max_seqs:
            tid = self.router.dequeue(key, self.now)
            if tid is None:
                return
            tr = self.trajs[tid]
            tr.bucket = self.router.bucket_of(tid) if not self.sys.pooled_routing else tr.bucket
            if not e.fits(tr.context, tr.spec.turns[tr.turn].output_tokens + KV_RESERVE) and e.n > 0:
                self.router.enqueue(tid, self.now)
                return
            self._run_turn(tid, e)

    def _turn_done(self, req: Request) -> None:
        tr = self.trajs[req.traj_id]
        turn = tr.spec.turns[tr.turn]
        if tr.engine is not None:
            self._attribute(tr, turn.output_tokens, self.engines[tr.engine].version)
        tr.attributed = 0
        tr.tokens += turn.output_tokens
        tr.context += turn.output_tokens
        tr.partial = 0
        if self.spec is not None and self.sys.drafter != "ngram":
            g = self.groups[tr.group]
            if self.sys.drafter == "group":
                g.turns_done[tr.turn] = g.turns_done.get(tr.turn, 0) + 1
            elif tr.engine is not None:
                key = (tr.engine, tr.turn)
                g.turns_done_on[key] = g.turns_done_on.get(key, 0) + 1
        tr.turn += 1
        if turn.tool is None:
            if tr.engine is not None:
                self.engines[tr.engine].forget(req.traj_id)
            self._finish(req.traj_id)
            return
        tr.in_tool = True
        self._push(self.now + turn.tool.latency_s, TOOL, req.traj_id)

    def _on_tool(self, tid: str) -> None:
        tr = self.trajs.get(tid)
        if tr is None:
            return  # aborted while in its tool: its group can no longer be trained
        tr.in_tool = False
        call = tr.spec.turns[tr.turn - 1].tool
        assert call is not None
        tr.tool_s += call.latency_s
        tr.context += call.payload_tokens
        d = self.router.on_tool_return(tid, call.signal, tr.tokens, tr.context, self.now)
        tr.bucket = d.bucket
        self._start_turn(tid)

    def _finish(self, tid: str) -> None:
        tr = self.trajs.pop(tid)
        self.router.finish(tid, tr.tokens, self.now)
        self.latencies.append(self.now - tr.admitted)
        self.waits.append((tr.queue_s, tr.tool_s))
        tr.finished = True
        self.finished += 1
        g = self.groups[tr.group]
        g.left -= 1
        g.tokens += tr.spec.context_tokens
        g.max_context = max(g.max_context, tr.spec.context_tokens)
        g.gen_tokens += tr.gen_tokens
        g.version_tokens += tr.version_tokens
        if g.left == 0:
            self.ready.append(tr.group)
            self._maybe_train()

    # ---- training -----------------------------------------------------------------------------

    def _maybe_train(self) -> None:
        if self.training or self.syncing or self.version >= self.steps or self.lend_state == "switching":
            return
        if self.bounded:
            # Every ready group is checked, not only the head: none older than the bound trains.
            floor = self.version - self.sys.staleness
            fresh = deque(g for g in self.ready if self.groups[g].version >= floor)
            for gid in set(self.ready) - set(fresh):
                self.groups.pop(gid)
                self.dropped_groups += 1
            self.ready = fresh
        if len(self.ready) < self.B:
            if self.sys.mode == "async":
                self._admit_async()  # replace dropped groups so the trainer is never starved
            return
        batch = [self.groups.pop(self.ready.popleft()) for _ in range(self.B)]
        self.trained_staleness.extend(self.version - g.version for g in batch)
        self.trained_token_staleness.extend(
            self.version - g.version_tokens / g.gen_tokens for g in batch if g.gen_tokens
        )
        tokens = sum(g.tokens for g in batch)
        n_traj = sum(len(g.trajs) for g in batch)
        max_seq = max(g.max_context for g in batch)
        gpus = self.sys.train_gpus if self.sys.mode == "async" else self.n_gpus
        if self.sys.mode == "sync":
            for e in self.engines.values():
                if self.sys.partial_rollout:
                    self.carried += self._evict(e)
                e.close(self.now)
            switch = self._switch_s()
            self.trainer.set("switch", self.now)
            start = self.now + switch
            self._push(start, SYNC_DONE, "to_train")
        elif self.lend_state == "lent":
            start = self.now + self._reclaim()
            self._push(start, SYNC_DONE, "to_train")
        else:
            start = self.now
            self.trainer.set("train_busy", self.now)
        extra = 0
        if self.pool is not None:
            # Hybrid workers enter the data-parallel group only at a step boundary.
            for w in self.pool.in_role(Role.CATCHING_UP):
                w.activate(self.now)
                self.hybrid_joins += 1
            for w in self.pool.in_role(Role.ACTIVE):
                extra += self.sys.hybrid_tp
                self.worker_meters[w.worker_id].set("train_busy", self.now)
        dur = self.cm.train_step_s(tokens, tokens / max(1, n_traj), gpus + extra, self.sys.train_tp, max_seq)
        self._last_train_s = dur
        self.train_durations.append(dur)
        self.training = True
        self._pending = (n_traj, tokens)
        self.train_gen += 1
        self._push(start + dur, TRAIN_DONE, None, self.train_gen)

    def _reclaim(self) -> float:
        """Take the lent engines back for training: running turns keep the tokens they generated
        and continue on other engines (re-prefilling their context). Returns the switch time."""
        self.lend_state = "training"
        moved: list[str] = []
        lent = {e.engine_id for e in self.lent}
        for e in self.lent:
            if self.sys.kv_migration:
                for req, _ in e.running():
                    dst = self._kv_target(req.traj_id, exclude=lent)
                    if dst is not None:
                        self._move(req.traj_id, e, dst)
            moved += self._evict(e)
            e.close(self.now)
        self.trainer.set("switch", self.now)
        for tid in moved:
            self._start_turn(tid)
        return self.cm.colocated_switch_s(self.sys.train_gpus, self.sys.lend_tp)

    def _evict(self, e: Engine) -> list[str]:
        """Stop every turn running on `e` because its GPUs go to training: each keeps the tokens it
        generated (counted at the engine's version) and will re-prefill its context wherever it
        continues; the engine's KV and prefix cache are gone. Returns the stopped trajectories."""
        running = e.running()
        e.abort(self.now, {req.traj_id for req, _ in running})
        stopped: list[str] = []
        for req, done in running:
            tr = self.trajs[req.traj_id]
            tr.partial += min(req.tokens - 1, int(done))
            self._attribute(tr, tr.partial, e.version)
            tr.engine = None
            stopped.append(req.traj_id)
        e.drop_cache()
        e.gen += 1
        return stopped

    def _switch_s(self) -> float:
        """Colocated role switch: offload/onload training state, reshard, sleep/wake the engines."""
        return self.cm.colocated_switch_s(self.n_gpus, self.sys.buckets[0].tp)

    def _on_train_done(self, gen: int) -> None:
        if gen != self.train_gen:
            return
        self.training = False
        self.version += 1
        self.step_ends.append(self.now)
        self.step_trajs.append(self._pending[0])
        self.step_tokens.append(self._pending[1])
        if self.progress is not None:
            self.progress.update(1)
        if self.pool is not None:
            for w in self.pool.in_role(Role.ACTIVE):
                self.worker_meters[w.worker_id].set("train_idle", self.now)
            for w in self.pool.in_role(Role.RELEASING):
                self._released(w.worker_id)
        if self.version >= self.steps:
            return
        if self.sys.mode == "sync":
            if self.bounded:
                self._abort_hopeless()
            self.trainer.set("switch", self.now)
            self._push(self.now + self._switch_s(), SYNC_DONE, "to_rollout")
            return
        self._abort_hopeless()
        self.trainer.set("train_sync", self.now)
        self.syncing = True
        for e in self.engines.values():
            if e.open_since is None:
                continue
            if self.sys.update_mode == "drain" and e.n > 0:
                self.draining.add(e.engine_id)
            else:
                self._load(e)
            self._wake(e)
        self._push(self.now + self.cm.weight_sync_s(cross_node=True), SYNC_DONE, "async")

    def _load(self, e: Engine) -> None:
        """The engine takes the newest weights (see :meth:`Engine.load_weights`)."""
        self.draining.discard(e.engine_id)
        for req, done in e.running():
            tr = self.trajs[req.traj_id]
            self._attribute(tr, tr.partial + int(done), e.version)
        self.reprefill_tokens += e.reprefill_tokens()
        e.load_weights(self.now, self.cm.engine_load_s(e.tp), self.version)

    def _abort_hopeless(self) -> None:
        """Cancel in-flight groups that are already older than the staleness bound: they could never
        be trained, and every system here frees their engine slots (AReaL bounds staleness at
        admission; the rest drop such groups, which is the same once they are replaced)."""
        floor = self.version - self.sys.staleness
        ready = set(self.ready)
        doomed = [gid for gid, g in self.groups.items() if g.version < floor and gid not in ready]
        for gid in doomed:
            g = self.groups.pop(gid)
            self.dropped_groups += 1
            by_engine: dict[str, set[str]] = {}
            for tid in g.trajs:
                tr = self.trajs.pop(tid, None)
                if tr is None:
                    continue
                self.aborted_trajectories += 1
                self.router.drop(tid)
                if tr.engine is not None:
                    by_engine.setdefault(tr.engine, set()).add(tid)
            for eid, tids in by_engine.items():
                e = self.engines[eid]
                e.abort(self.now, tids)
                self._wake(e)

    def _on_sync_done(self, what: str) -> None:
        if what == "to_train":
            self.trainer.set("train_busy", self.now)
            return
        if what == "to_rollout":
            self.trainer.set(None, self.now)
            for e in self.engines.values():
                e.load_weights(self.now, 0.0, self.version)
                e.open(self.now)
            self._admit_sync()
            return
        if what == "lend":
            self.lend_state = "lent"
            self.trainer.set(None, self.now)
            for e in self.lent:
                e.open(self.now)
                e.load_weights(self.now, 0.0, self.version)
                self._fill(e)
                self._wake(e)
            self._maybe_train()
            return
        self.syncing = False
        self.trainer.set("train_idle", self.now)
        self._admit_async()
        if self.lent and len(self.ready) < self.B:
            self.lend_state = "switching"
            self.trainer.set("switch", self.now)
            self._push(
                self.now + self.cm.colocated_switch_s(self.sys.train_gpus, self.sys.lend_tp),
                SYNC_DONE,
                "lend",
            )
            return
        self._maybe_train()

    def _admit_sync(self) -> None:
        """A colocated rollout phase starts: turns stopped by the last step first (APRIL's
        prioritised resumption), then turns that came back from their tools meanwhile, then new
        groups up to the batch times the over-provision ratio, counting the groups carried."""
        if not self.sys.partial_rollout:
            self._admit(self.B)
            return
        carried, self.carried = self.carried, []
        for tid in carried:
            if tid in self.trajs:  # its group may have been dropped as too stale
                self._start_turn(tid)
        for e in self.engines.values():
            self._fill(e)
            self._wake(e)
        # AReaL's admission rule bounds it too: with v·B groups trained and the dropped ones
        # replaced, (v + η + 1)·B admitted means at most (η + 1)·B in flight.
        target = min(math.ceil(self.sys.partial_rollout * self.B), (self.sys.staleness + 1) * self.B)
        self._admit(max(0, target - len(self.groups)))

    def _admit_async(self) -> None:
        """Bounded staleness at admission (AReaL's rule): at most (version + staleness + 1) batches
        admitted, not counting groups that were dropped as too stale."""
        allowed = (self.version + self.sys.staleness + 1) * self.B + self.dropped_groups
        if self.sys.job_groups is not None:
            allowed = min(allowed, self.sys.job_groups + self.dropped_groups)
        if self.admitted_groups < allowed:
            self._admit(allowed - self.admitted_groups)

    # ---- hybrid pool and replanning -----------------------------------------------------------

    def _on_tick(self) -> None:
        self._sample_timeline()
        if self.router.queued():
            # Engines with nothing running get no events of their own; let them pull aged turns.
            for e in self.engines.values():
                if e.n == 0 and self._serving(e):
                    self._fill(e)
                    self._wake(e)
        if self.sys.kv_migration:
            self._consolidate()
        if self.pool is not None and self.sys.mode == "async":
            self._pool_tick()
        if self.sys.replan is not None:
            self._replan_tick()
        if self.version < self.steps:
            self._push(self.now + self.tick_s, TICK, None)

    def _consolidate(self) -> None:
        """Even out running turns across each bucket's engines, moving the longest-running ones
        with their KV, where no queued turn would fill the idle engines anyway."""
        for key, pool in self.by_bucket.items():
            if len(pool) < 2 or self.router.queued(key):
                continue
            serving = {e.engine_id: e for e in pool if self._serving(e)}
            slots = [EngineSlots(i, e.n + self.inbound.get(i, 0), e.max_seqs) for i, e in serving.items()]
            for src_id, dst_id in consolidation_moves(slots):
                src, dst = serving[src_id], serving[dst_id]
                running = sorted(src.running(), key=lambda x: -x[1])
                for req, _ in running:
                    if self._kv_fits(req.traj_id, dst):
                        self._move(req.traj_id, src, dst)
                        break

    def _kv_fits(self, tid: str, e: Engine) -> bool:
        tr = self.trajs[tid]
        return e.fits(tr.context + tr.partial, tr.spec.turns[tr.turn].output_tokens + KV_RESERVE) and (
            e.n + self.inbound.get(e.engine_id, 0) < e.max_seqs
        )

    def _kv_target(self, tid: str, exclude: set[str]) -> Engine | None:
        """The serving engine with the fewest running turns that has room for this one's KV."""
        tr = self.trajs[tid]
        best = None
        for e in self.by_bucket.get(self._key(tr.bucket), []):
            if e.engine_id in exclude or not self._serving(e):
                continue
            load = e.n + self.inbound.get(e.engine_id, 0)
            if (best is None or load < best[0]) and self._kv_fits(tid, e):
                best = (load, e)
        return best[1] if best else None

    def _move(self, tid: str, src: Engine, dst: Engine) -> None:
        """Detach a running turn and send its KV to `dst`; it resumes there on arrival."""
        out = src.detach(self.now, tid)
        if out is None:
            return
        req, done = out
        tr = self.trajs[tid]
        tr.partial += min(req.tokens - 1, int(done))
        self._attribute(tr, tr.partial, src.version)
        tokens = tr.context + tr.partial
        tr.engine = None
        self.kv_moves += 1
        self.kv_sent_tokens += tokens
        self.inbound[dst.engine_id] = self.inbound.get(dst.engine_id, 0) + 1
        arrive = self.now + self.cm.kv_transfer_s(tokens, min(src.tp, dst.tp))
        self._push(arrive, MOVED, (tid, dst.engine_id, src.version, tokens))
        if src.n == 0 and src.engine_id in self.draining:
            self._load(src)
        self._wake(src)

    def _on_moved(self, payload: tuple[str, str, int, int]) -> None:
        tid, eid, version, tokens = payload
        self.kv_received_tokens += tokens
        self.inbound[eid] -= 1
        tr = self.trajs.get(tid)
        if tr is None:
            return  # aborted in transit: its group can no longer be trained
        e = self.engines[eid]
        turn = tr.spec.turns[tr.turn]
        if (
            version != e.version
            or not self._serving(e)
            or not e.fits(tokens, turn.output_tokens - tr.partial)
        ):
            self.kv_fallbacks += 1
            self._start_turn(tid)  # the KV is stale or has no room: re-prefill wherever it goes
            return
        tr.engine = eid
        self.router.moved(tid, eid)
        req = Request(tid, turn.output_tokens - tr.partial, tokens, acceptance=self._acceptance(tr, e))
        e.join(req, self.now, 0, tr.spec.prompt_id)
        self._wake(e)

    def _hybrid_demand(self) -> float:
        """(running + queued turns) over the turn slots of the hybrid workers' bucket."""
        key = self._key(self.hybrid_bucket)
        engines = [e for e in self.by_bucket.get(key, []) if e.accepting and e.open_since is not None]
        running = sum(e.n for e in engines)
        waiting = self.router.queued(key)
        return (running + waiting) / max(1, 16 * len(engines))

    def _pool_tick(self) -> None:
        assert self.pool is not None
        waiting = self.training or len(self.ready) >= self.B
        for a in self.pool.decide(self.now, self._hybrid_demand(), waiting):
            w = self.pool.workers[a.worker_id]
            e = self.engines[a.worker_id]
            if a.action == "join":
                w.request_join(self.now)
                e.accepting = False
                if e.n == 0:
                    self._start_fetch(a.worker_id)
            elif a.action == "cancel":
                if w.role != Role.REQUESTED:
                    self.worker_meters[w.worker_id].set(None, self.now)
                    self._reopen(e)
                w.cancel(self.now)
                e.accepting = True
                self._fill(e)
                self._wake(e)
            elif a.action == "release":
                w.release(self.now)
                if not self.training:
                    self._released(w.worker_id)

    def _start_fetch(self, wid: str) -> None:
        assert self.pool is not None
        w = self.pool.workers[wid]
        e = self.engines[wid]
        e.close(self.now)
        e.drop_cache()
        w.start_fetch(self.now)
        self.worker_meters[wid].set("switch", self.now)
        self._push(self.now + self.cm.state_fetch_s(self.sys.train_gpus), FETCHED, wid)

    def _on_fetched(self, wid: str) -> None:
        assert self.pool is not None
        w = self.pool.workers[wid]
        if w.role != Role.FETCHING_STATE:
            return
        w.fetched(self.now)
        self.worker_meters[wid].set("train_idle", self.now)
        if not self.training:
            self._maybe_train()

    def _reopen(self, e: Engine) -> None:
        """A hybrid worker serves rollout again: it reloads the engine with the current weights."""
        e.open(self.now)
        e.load_weights(self.now, self.cm.engine_load_s(e.tp), self.version)

    def _released(self, wid: str) -> None:
        assert self.pool is not None
        w = self.pool.workers[wid]
        w.released(self.now)
        self.worker_meters[wid].set(None, self.now)
        e = self.engines[wid]
        e.accepting = True
        self._reopen(e)
        self._fill(e)
        self._wake(e)

    def _replan_tick(self) -> None:
        """Re-fit bucket thresholds to the recent length distribution when a trigger fires."""
        rp = self.sys.replan
        assert rp is not None
        finished = [t.tokens for t in self.recent if t.finished]
        if len(self.sys.buckets) < 2 or len(finished) < self.B * self.wl.group_size:
            return
        slots = sum(e.max_seqs for e in self.engines.values() if e.accepting) or 1
        interval = self.step_ends[-1] - self.step_ends[-2] if len(self.step_ends) > 1 else self._last_train_s
        ratio = interval / self._last_train_s if self._last_train_s else 1.0
        sig = ReplanSignals(self.router.queued() / slots, 0, ratio)
        fire, reason = rp.should_replan(self.now, sig)
        if not fire:
            return
        stats = self.workload_stats(
            length_sample(finished, [t.tokens for t in self.recent if not t.finished])
        )
        refit = refit_thresholds(self.cm, stats, self.sys.buckets, SearchOptions(max_seqs=self.sys.max_seqs))
        best, cur, best_t = refit.buckets, refit.current_s, refit.best_s
        applied = best is not None and rp.accept(self.now, cur, best_t, 0.0)
        if not applied:
            rp.last_replan = self.now
        self.replans.append({"t": self.now, "reason": reason, "applied": applied, "pred_s": [cur, best_t]})
        if applied and best is not None and not self.sys.pooled_routing:
            self.sys.buckets = best
            self.router.set_thresholds({b.name: b.max_tokens for b in best})

    def workload_stats(self, lengths: Sequence[float]) -> WorkloadStats:
        base = self.sys.notes.get("profile")
        if isinstance(base, WorkloadStats):
            return WorkloadStats(
                base.trajectories_per_step,
                lengths,
                base.mean_turns,
                base.mean_tool_s,
                base.prompt_tokens,
                base.context_per_output,
            )
        return workload_stats(self.wl, lengths)

    def _sample_timeline(self) -> None:
        roll = sum(e.tp for e in self.engines.values() if e.open_since is not None and e.n > 0)
        train = self.trainer.gpus if self.trainer.state == "train_busy" else 0
        if self.pool is not None:
            train += sum(1 for m in self.worker_meters.values() if m.state == "train_busy")
        switch = self.trainer.gpus if self.trainer.state in ("switch", "train_sync") else 0
        self.timeline.append((self.now, roll, train, switch))

    # ---- main loop ----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        if self.sys.mode == "sync":
            for e in self.engines.values():
                e.open(0.0)
            self._admit_sync()
        else:
            for e in self.engines.values():
                e.open(0.0)
            if self.lent:
                self.lend_state = "lent"
            else:
                self.trainer.set("train_idle", 0.0)
            self._admit_async()
        self._push(0.0, TICK, None)
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
                self._on_tool(payload)
            elif kind == TRAIN_DONE:
                self._on_train_done(gen)
            elif kind == SYNC_DONE:
                self._on_sync_done(payload)
            elif kind == FETCHED:
                self._on_fetched(payload)
            elif kind == TICK:
                self._on_tick()
            elif kind == MOVED:
                self._on_moved(payload)
        if self.version < self.steps:
            raise RuntimeError(f"{self.sys.name}: simulation stalled at step {self.version}")
        return self._close()

    def _close(self) -> dict[str, Any]:
        end = self.now
        for e in self.engines.values():
            if e.open_since is not None:
                e.close(end)
            busy = min(e.busy_s, e.opened_s)
            sync = min(e.sync_s, busy)
            self.ledger.add("rollout_sync", sync * e.tp)
            self.ledger.add("rollout_busy", (busy - sync) * e.tp)
            self.ledger.add("rollout_idle", (e.opened_s - busy) * e.tp)
        self.trainer.set(None, end)
        for m in self.worker_meters.values():
            m.set(None, end)
        return {"end": end}


def turn_payload(tr: _Traj) -> int:
    """Tokens a turn on the same engine must prefill: the tool return appended since the last turn."""
    if tr.turn == 0:
        return tr.context
    call = tr.spec.turns[tr.turn - 1].tool
    return call.payload_tokens if call else 1


def workload_stats(
    w: Workload, lengths: Sequence[float], specs: list[TrajectorySpec] | None = None
) -> WorkloadStats:
    """Planner input from finished lengths (live) or sampled trajectories (profiling)."""
    if specs:
        out = sum(s.output_tokens for s in specs) / len(specs)
        ctx = sum(s.context_tokens - s.prompt_tokens for s in specs) / len(specs)
        turns = sum(len(s.turns) for s in specs) / len(specs)
        tool = sum(s.tool_time_s for s in specs) / max(1.0, sum(len(s.turns) - 1 for s in specs))
        prompt = sum(s.prompt_tokens for s in specs) / len(specs)
        lengths = [s.output_tokens for s in specs]
        return WorkloadStats(
            w.prompts_per_step * w.group_size, lengths, turns, tool, prompt, ctx / max(1.0, out)
        )
    return WorkloadStats(w.prompts_per_step * w.group_size, lengths, w.max_turns / 2, 5.0, 2000.0, 2.0)
