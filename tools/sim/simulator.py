"""Discrete-event simulator of an agentic RL run: rollout engines, tools, trainer, planner, pool.

One heap of events (engine turn completions, tool returns, training steps, weight syncs, hybrid
pool transitions, ticks). Engines aggregate decode iterations (see :mod:`tools.sim.engine`), so
the event count scales with turns, not tokens. Routing, planning and pool decisions come from the
same core modules the services use.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from services.planner.cost_model import CostModel
from services.planner.hybrid_pool import HybridPool, PoolPolicy, Role
from services.planner.replan import ReplanPolicy, ReplanSignals
from services.planner.search import BucketPlan, SearchOptions, WorkloadStats, rollout_time
from services.scheduler.cmlfq import EngineView
from tools.sim.engine import Engine, Request
from tools.sim.ledger import Ledger, Meter
from tools.sim.workload import TrajectorySpec, Workload

ENGINE, TOOL, TRAIN_DONE, SYNC_DONE, FETCHED, TICK = range(6)
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
    staleness: int = 1
    max_seqs: int = 128
    pool_policy: PoolPolicy | None = None
    replan: ReplanPolicy | None = None
    pooled_routing: bool = False
    """Route across all engines as one bucket (the no-C-MLFQ ablation)."""
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Traj:
    spec: TrajectorySpec
    group: int
    admitted: float
    bucket: str
    turn: int = 0
    tokens: int = 0
    context: int = 0
    engine: str | None = None
    in_tool: bool = False


@dataclass(slots=True)
class _Group:
    version: int
    left: int
    trajs: list[str]
    tokens: int = 0


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
        self.finished = 0
        self.dropped_groups = 0
        self.migrations = 0
        self.reprefill_tokens = 0
        self.timeline: list[tuple[float, int, int, int]] = []
        self.replans: list[dict[str, Any]] = []
        self.recent_lengths: deque[int] = deque(maxlen=4 * self.B * workload.group_size)
        self._last_train_s = 0.0
        self.train_durations: list[float] = []
        self.train_gen = 0
        self._train_gpus = 0
        self._train_work = 0.0
        self._train_t = 0.0
        self.mid_step_joins = 0
        self._build()

    def _push(self, t: float, kind: int, payload: Any, gen: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t, self._seq, kind, payload, gen))

    def _build(self) -> None:
        s = self.sys
        i = 0
        for b in s.buckets:
            for _ in range(b.replicas):
                self._add_engine(f"e{i}", b.name, b.tp, hybrid=False)
                i += 1
        first = s.buckets[0].name if s.buckets else "short"
        hybrid_ids = []
        for _ in range(s.hybrid_gpus):
            self._add_engine(f"e{i}", first, 1, hybrid=True)
            hybrid_ids.append(f"e{i}")
            i += 1
        self.pool = HybridPool(hybrid_ids, s.pool_policy) if hybrid_ids else None
        self.worker_meters = {w: Meter(self.ledger, 1) for w in hybrid_ids}
        self.trainer = Meter(self.ledger, s.train_gpus if s.mode == "async" else self.n_gpus)
        used = s.train_gpus + sum(b.gpus for b in s.buckets) + s.hybrid_gpus if s.mode == "async" else None
        if s.mode == "async" and used != self.n_gpus:
            raise ValueError(f"{s.name}: allocation uses {used} GPUs, cluster has {self.n_gpus}")

    def _add_engine(self, eid: str, bucket: str, tp: int, hybrid: bool) -> None:
        e = Engine(eid, bucket, tp, self.cm, self.sys.max_seqs, hybrid)
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
            specs = self.wl.sample_group(random.Random(f"{self.seed}:{gid}"), pid, self.version)
            g = _Group(self.version, len(specs), [])
            self.groups[gid] = g
            for k, spec in enumerate(specs):
                tid = f"{pid}s{k}"
                bucket = self.router.admit(tid, pid, self.now, spec.output_tokens)
                tr = _Traj(spec, gid, self.now, bucket, context=spec.prompt_tokens)
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
            if e.accepting and e.open_since is not None
        ]
        eid = self.router.pick_engine(key, views, tid) if views else None
        if eid is None:
            self.router.enqueue(tid, self.now)
            return
        self._run_turn(tid, self.engines[eid])

    def _run_turn(self, tid: str, e: Engine) -> None:
        tr = self.trajs[tid]
        turn = tr.spec.turns[tr.turn]
        if tr.engine == e.engine_id:
            prefill = turn_payload(tr)
        else:
            cached = tr.spec.prompt_tokens if tr.spec.prompt_id in e.prompts else 0
            prefill = tr.context - cached
            if tr.engine is not None:
                self.migrations += self.engines[tr.engine].bucket != e.bucket
                self.reprefill_tokens += prefill
        tr.engine = e.engine_id
        e.join(Request(tid, turn.output_tokens, tr.context), self.now, max(1, prefill), tr.spec.prompt_id)
        self._wake(e)

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
        self._fill(e)
        self._wake(e)
        if not e.accepting and e.n == 0 and self.pool is not None:
            w = self.pool.workers.get(eid)
            if w is not None and w.role == Role.REQUESTED:
                self._start_fetch(eid)

    def _fill(self, e: Engine) -> None:
        if not e.accepting or e.open_since is None:
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
        tr.tokens += turn.output_tokens
        tr.context += turn.output_tokens
        tr.turn += 1
        if turn.tool is None:
            self._finish(req.traj_id)
            return
        tr.in_tool = True
        self._push(self.now + turn.tool.latency_s, TOOL, req.traj_id)

    def _on_tool(self, tid: str) -> None:
        tr = self.trajs[tid]
        tr.in_tool = False
        call = tr.spec.turns[tr.turn - 1].tool
        assert call is not None
        tr.context += call.payload_tokens
        d = self.router.on_tool_return(tid, call.signal, tr.tokens, tr.context, self.now)
        tr.bucket = d.bucket
        self._start_turn(tid)

    def _finish(self, tid: str) -> None:
        tr = self.trajs.pop(tid)
        self.router.finish(tid, tr.tokens, self.now)
        self.latencies.append(self.now - tr.admitted)
        self.recent_lengths.append(tr.tokens)
        self.finished += 1
        g = self.groups[tr.group]
        g.left -= 1
        g.tokens += tr.spec.context_tokens
        if g.left == 0:
            self.ready.append(tr.group)
            self._maybe_train()

    # ---- training -----------------------------------------------------------------------------

    def _maybe_train(self) -> None:
        if self.training or self.syncing or self.version >= self.steps:
            return
        if self.sys.mode == "async":
            while self.ready and self.groups[self.ready[0]].version < self.version - self.sys.staleness:
                self.groups.pop(self.ready.popleft())
                self.dropped_groups += 1
        if len(self.ready) < self.B:
            return
        batch = [self.groups.pop(self.ready.popleft()) for _ in range(self.B)]
        tokens = sum(g.tokens for g in batch)
        n_traj = sum(len(g.trajs) for g in batch)
        gpus = self.sys.train_gpus if self.sys.mode == "async" else self.n_gpus
        if self.sys.mode == "sync":
            for e in self.engines.values():
                e.close(self.now)
            switch = self._switch_s()
            self.trainer.set("switch", self.now)
            start = self.now + switch
        else:
            start = self.now
            self.trainer.set("train_busy", self.now)
        extra = 0
        if self.pool is not None:
            for w in self.pool.in_role(Role.CATCHING_UP):
                w.activate(self.now)
            for w in self.pool.in_role(Role.ACTIVE):
                extra += 1
                self.worker_meters[w.worker_id].set("train_busy", self.now)
        dur = self.cm.train_step_s(tokens, tokens / max(1, n_traj), gpus + extra, self.sys.train_tp)
        self._last_train_s = dur
        self.train_durations.append(dur)
        self.training = True
        self._pending = (n_traj, tokens)
        # Training progress as GPU-seconds of work, so a replica joining mid-step shortens the rest.
        self._train_gpus = gpus + extra
        self._train_work = dur * self._train_gpus
        self._train_t = start
        if self.sys.mode == "sync":
            self._push(start, SYNC_DONE, "to_train")
        self.train_gen += 1
        self._push(start + dur, TRAIN_DONE, None, self.train_gen)

    def _switch_s(self) -> float:
        """Colocated role switch: reshard weights between trainer and engines, wake/sleep engines."""
        return self.cm.weight_sync_s(cross_node=False)

    def _add_train_replica(self) -> None:
        """A hybrid worker enters the data-parallel group mid-step: the remaining work is re-split."""
        now = max(self.now, self._train_t)
        self._train_work -= (now - self._train_t) * self._train_gpus
        self._train_t = now
        self._train_gpus += 1
        self.train_gen += 1
        self.mid_step_joins += 1
        self._push(now + max(0.0, self._train_work) / self._train_gpus, TRAIN_DONE, None, self.train_gen)

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
            self.trainer.set("switch", self.now)
            self._push(self.now + self._switch_s(), SYNC_DONE, "to_rollout")
            return
        sync = self.cm.weight_sync_s(cross_node=True)
        self.trainer.set("train_sync", self.now)
        self.syncing = True
        load = self.cm.model.weight_bytes / self.cm.gpu.net_bw
        for e in self.engines.values():
            if e.open_since is not None:
                e.stall(self.now, load / e.tp, sync=True)
                self._wake(e)
        self._push(self.now + sync, SYNC_DONE, "async")

    def _on_sync_done(self, what: str) -> None:
        if what == "to_train":
            self.trainer.set("train_busy", self.now)
            return
        if what == "to_rollout":
            self.trainer.set(None, self.now)
            for e in self.engines.values():
                e.open(self.now)
            self._admit(self.B)
            return
        self.syncing = False
        self.trainer.set("train_idle", self.now)
        self._admit_async()
        self._maybe_train()

    def _admit_async(self) -> None:
        allowed = (self.version + self.sys.staleness + 1) * self.B
        if self.admitted_groups < allowed:
            self._admit(allowed - self.admitted_groups)

    # ---- hybrid pool and replanning -----------------------------------------------------------

    def _on_tick(self) -> None:
        self._sample_timeline()
        if self.router.queued():
            # Engines with nothing running get no events of their own; let them pull aged turns.
            for e in self.engines.values():
                if e.n == 0 and e.accepting and e.open_since is not None:
                    self._fill(e)
        if self.pool is not None and self.sys.mode == "async":
            self._pool_tick()
        if self.sys.replan is not None:
            self._replan_tick()
        if self.version < self.steps:
            self._push(self.now + self.tick_s, TICK, None)

    def _bucket0_demand(self) -> float:
        b0 = self.sys.buckets[0].name
        engines = [
            e for e in self.by_bucket.get(self._key(b0), []) if e.accepting and e.open_since is not None
        ]
        running = sum(e.n for e in engines if e.bucket == b0)
        waiting = self.router.queued(self._key(b0))
        return (running + waiting) / max(1, 16 * sum(1 for e in engines if e.bucket == b0))

    def _pool_tick(self) -> None:
        assert self.pool is not None
        waiting = self.training or len(self.ready) >= self.B
        for a in self.pool.decide(self.now, self._bucket0_demand(), waiting):
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
                    e.open(self.now)
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
        w.start_fetch(self.now)
        self.worker_meters[wid].set("switch", self.now)
        self._push(self.now + self.cm.state_fetch_s(self.sys.train_gpus), FETCHED, wid)

    def _on_fetched(self, wid: str) -> None:
        assert self.pool is not None
        w = self.pool.workers[wid]
        if w.role != Role.FETCHING_STATE:
            return
        w.fetched(self.now)
        if self.training and self.sys.mode == "async":
            w.activate(self.now)
            self.worker_meters[wid].set("train_busy", self.now)
            self._add_train_replica()
        else:
            self.worker_meters[wid].set("train_idle", self.now)

    def _released(self, wid: str) -> None:
        assert self.pool is not None
        w = self.pool.workers[wid]
        w.released(self.now)
        self.worker_meters[wid].set(None, self.now)
        e = self.engines[wid]
        e.accepting = True
        e.open(self.now)
        e.stall(self.now, 0.5)
        self._fill(e)
        self._wake(e)

    def _replan_tick(self) -> None:
        """Re-fit bucket thresholds to the recent length distribution when a trigger fires."""
        rp = self.sys.replan
        assert rp is not None
        if len(self.sys.buckets) < 2 or len(self.recent_lengths) < self.B * self.wl.group_size:
            return
        slots = sum(e.max_seqs for e in self.engines.values() if e.accepting) or 1
        interval = self.step_ends[-1] - self.step_ends[-2] if len(self.step_ends) > 1 else self._last_train_s
        ratio = interval / self._last_train_s if self._last_train_s else 1.0
        sig = ReplanSignals(self.router.queued() / slots, 0, ratio)
        fire, reason = rp.should_replan(self.now, sig)
        if not fire:
            return
        stats = self.workload_stats(list(self.recent_lengths))
        opts = SearchOptions(max_seqs=self.sys.max_seqs)
        cur = rollout_time(self.cm, stats, self.sys.buckets, opts)
        best, best_t = None, cur
        xs = sorted(self.recent_lengths)
        qs = sorted({xs[min(len(xs) - 1, int(q * len(xs)))] for q in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)})
        k = len(self.sys.buckets)
        for cut in itertools.combinations(qs, k - 1):
            cand = [
                BucketPlan(b.name, b.tp, b.replicas, t)
                for b, t in zip(self.sys.buckets, (*cut, math.inf), strict=True)
            ]
            t = rollout_time(self.cm, stats, cand, opts)
            if t < best_t:
                best, best_t = cand, t
        applied = best is not None and rp.accept(self.now, cur, best_t, 0.0)
        if not applied:
            rp.last_replan = self.now
        self.replans.append({"t": self.now, "reason": reason, "applied": applied, "pred_s": [cur, best_t]})
        if applied and best is not None and hasattr(self.router, "core"):
            self.sys.buckets = best
            core = self.router.core
            core.buckets = [
                type(cb)(cb.name, cb.tp, nb.max_tokens, cb.tpot)
                for cb, nb in zip(core.buckets, best, strict=False)
            ]

    def workload_stats(self, lengths: list[int]) -> WorkloadStats:
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
            self._admit(self.B)
        else:
            for e in self.engines.values():
                if not e.hybrid or self.pool is not None:
                    e.open(0.0)
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
    w: Workload, lengths: list[int], specs: list[TrajectorySpec] | None = None
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
