"""The training side of a simulated run: when a step starts (a batch of complete groups within the
staleness bound), how long it takes (`CostModel.train_step_s`), how weights reach the engines
after it, and how GPUs switch roles — a colocated system's whole cluster between the two stages
(with APRIL's partial rollout carrying the turns it stops), or an asynchronous trainer's GPUs lent
to rollout while it waits for its batch. Admission under the staleness bound is here too."""

from __future__ import annotations

import math
from collections import deque

from services.policy.lend_policy import LendPolicy
from services.policy.staleness import StalenessBound, training_order
from services.simulation.engine import Engine
from services.simulation.kernel import Kernel
from services.simulation.ledger import Meter
from services.simulation.state import SYNC_DONE, TRAIN_DONE


class Training:
    def __init__(self, sim: Kernel, lent: list[Engine]):
        self.sim = sim
        s = sim.sys
        self.meter = Meter(sim.ledger, s.train_gpus if s.mode == "async" else sim.n_gpus)
        """The trainer's GPUs (all of them for a colocated system)."""
        self.bounded = s.mode == "async" or s.partial_rollout > 0
        """Whether groups can be trained after a weight update, so the staleness bound applies."""
        self.bound = StalenessBound(s.staleness)
        self.busy = False
        """A step is training."""
        self.syncing = False
        self.carried: list[str] = []
        """Trajectories whose running turn stopped when a partial-rollout step started training."""
        self.lent = lent
        """Engines on the trainer's GPUs, serving while it waits for a batch (`SystemConfig.lend_tp`)."""
        self.lend_state = "training"
        """training (the GPUs are the trainer's), lent, switching (to rollout), reclaiming (early)."""
        lent_gpus = len(lent) * s.lend_tp
        self.policy = LendPolicy(
            sim.cm.colocated_switch_s(s.train_gpus, s.lend_tp) if lent else 0.0,
            s.lend_policy,
            lent_share=lent_gpus / (lent_gpus + sum(b.gpus for b in s.buckets)) if lent else 0.0,
        )
        self.lends = self.reclaims = self.early_reclaims = 0
        self.reclaim_due: float | None = None
        """When the policy takes the lent GPUs back unless a group completes first."""
        self.last_step_s = 0.0
        self.durations: list[float] = []
        """Each training step's seconds."""
        self.pushes: list[float] = []
        """Each asynchronous push's seconds (the trainer's side, `weight_sync_s`)."""
        self.gen = 0
        self._pending = (0, 0)

    def start(self) -> None:
        """The run begins: rollout first (a colocated system), else the trainer waits (or lends)."""
        sim = self.sim
        if sim.sys.mode == "sync":
            self.admit_sync()
            return
        if self.lent:  # the run starts with nothing to train: the GPUs start out lent
            self.lend_state = "lent"
            self.lends += 1
        else:
            self.meter.set("train_idle", 0.0)
        self.admit_async()

    def maybe_train(self) -> None:
        sim = self.sim
        s = sim.sys
        if self.busy or self.syncing or sim.version >= sim.steps or self.lend_state == "switching":
            return
        if self.bounded:
            # Every ready group is checked, not only the head: none past the bound trains, and the
            # rest train oldest token first, as the live trainer takes them.
            fresh = [
                (g, sim.groups[g].oldest_version)
                for g in sim.ready
                if not self.bound.is_stale(sim.groups[g].oldest_version, sim.version)
            ]
            for gid in set(sim.ready) - {g for g, _ in fresh}:
                sim.groups.pop(gid)
                sim.dropped_groups += 1
                sim.log("drop", gid, sim.version)
            sim.ready = deque(training_order(fresh))
        if len(sim.ready) < sim.B:
            if s.mode == "async":
                self.admit_async()  # replace dropped groups so the trainer is never starved
            if self.lent:
                self.lend_or_reclaim()
            return
        if self.lend_state == "reclaiming":
            return  # the GPUs are on their way back; the step starts when they are
        gids = [sim.ready.popleft() for _ in range(sim.B)]
        sim.log("train", sim.version, gids)
        batch = [sim.groups.pop(gid) for gid in gids]
        sim.trained_staleness.extend(sim.version - g.version for g in batch)
        sim.trained_oldest_staleness.extend(
            sim.version - g.oldest_version for g in batch if g.oldest_version is not None
        )
        sim.trained_token_staleness.extend(
            sim.version - g.version_tokens / g.gen_tokens for g in batch if g.gen_tokens
        )
        tokens = sum(g.tokens for g in batch)
        n_traj = sum(len(g.trajs) for g in batch)
        max_seq = max(g.max_context for g in batch)
        gpus = s.train_gpus if s.mode == "async" else sim.n_gpus
        if s.mode == "sync":
            for e in sim.engines.values():
                if s.partial_rollout:
                    self.carried += self.evict(e)
                e.close(sim.now)
            switch = self.switch_s()
            self.meter.set("switch", sim.now)
            start = sim.now + switch
            sim.push(start, SYNC_DONE, "to_train")
        elif self.lend_state == "lent":
            start = sim.now + self.reclaim()
            sim.push(start, SYNC_DONE, "to_train")
        else:
            start = sim.now
            self.meter.set("train_busy", sim.now)
        extra = sim.hybrid.step_starts()
        dur = sim.cm.train_step_s(tokens, tokens / max(1, n_traj), gpus + extra, s.train_tp, max_seq)
        if s.trainer_on_host:  # it shares the host's cores with the engines busy as it starts
            dur *= sim.host.pace(len(sim.host.busy_engines()))
        self.last_step_s = dur
        self.durations.append(dur)
        self.busy = True
        self._pending = (n_traj, tokens)
        self.gen += 1
        sim.push(start + dur, TRAIN_DONE, None, self.gen)

    def group_complete(self) -> None:
        """A group's last trajectory finished: the lending forecast hears of it (also while the
        trainer trains), then the trainer may start a step."""
        if self.lent:
            self.policy.completed(self.sim.now)
            if len(self.sim.ready) >= self.sim.B:
                self.policy.batch_complete()
        self.maybe_train()

    def lend_or_reclaim(self) -> None:
        """No batch is complete: the policy lends the trainer's idle GPUs, or takes lent ones back
        ahead of the batch (checked again when a group completes or the forecast's time comes)."""
        sim = self.sim
        ready, need = len(sim.ready), sim.B
        if self.lend_state == "training" and self.policy.should_lend(sim.now, ready, need):
            self.lend_state = "switching"
            self.lends += 1
            self.meter.set("switch", sim.now)
            sim.push(sim.now + self.policy.switch_s, SYNC_DONE, "lend")
        elif self.lend_state == "lent":
            self.reclaim_due = self.policy.reclaim_at(sim.now, ready, need)
            if self.reclaim_due is None:
                return
            if self.reclaim_due > sim.now:
                sim.push(self.reclaim_due, SYNC_DONE, "reclaim_due")
                return
            self.lend_state = "reclaiming"
            self.early_reclaims += 1
            self.reclaim_due = None
            sim.push(sim.now + self.reclaim(), SYNC_DONE, "reclaimed")

    def reclaim(self) -> float:
        """Take the lent engines back for training: running turns keep the tokens they generated
        and continue on other engines (re-prefilling their context). Returns the switch time."""
        sim = self.sim
        self.lend_state = "training"
        self.reclaims += 1
        moved: list[str] = []
        lent = {e.engine_id for e in self.lent}
        for e in self.lent:
            if sim.sys.kv_migration:
                for req, _ in e.running():
                    dst = sim.kvm.target(req.traj_id, exclude=lent)
                    if dst is not None:
                        sim.kvm.move(req.traj_id, e, dst)
            moved += self.evict(e)
            e.close(sim.now)
        self.meter.set("switch", sim.now)
        for tid in moved:
            sim.start_turn(tid)
        return self.policy.switch_s

    def evict(self, e: Engine) -> list[str]:
        """Stop every turn running on `e` because its GPUs go to training: each keeps the tokens it
        generated (counted at the engine's version) and will re-prefill its context wherever it
        continues; the engine's KV and prefix cache are gone. Returns the stopped trajectories."""
        sim = self.sim
        running = e.running()
        e.abort(sim.now, {req.traj_id for req, _ in running})
        stopped: list[str] = []
        for req, done in running:
            tr = sim.trajs[req.traj_id]
            tr.partial += min(req.tokens - 1, int(done))
            tr.attribute(tr.partial, e.version)
            tr.engine = None
            stopped.append(req.traj_id)
        e.drop_cache()
        e.gen += 1
        return stopped

    def switch_s(self) -> float:
        """Colocated role switch: offload/onload training state, reshard, sleep/wake the engines."""
        return self.sim.cm.colocated_switch_s(self.sim.n_gpus, self.sim.sys.buckets[0].tp)

    def on_done(self, gen: int) -> None:
        sim = self.sim
        if gen != self.gen:
            return
        self.busy = False
        sim.version += 1
        sim.step_ends.append(sim.now)
        sim.step_trajs.append(self._pending[0])
        sim.step_tokens.append(self._pending[1])
        if sim.progress is not None:
            sim.progress.update(1)
        sim.hybrid.step_ends()
        if sim.version >= sim.steps:
            return
        if sim.sys.mode == "sync":
            if self.bounded:
                sim.lives.abort_hopeless(self.bound)
            self.meter.set("switch", sim.now)
            sim.push(sim.now + self.switch_s(), SYNC_DONE, "to_rollout")
            return
        sim.lives.abort_hopeless(self.bound)
        self.meter.set("train_sync", sim.now)
        self.syncing = True
        for e in sim.engines.values():
            if e.open_since is None:
                continue
            if sim.sys.update_mode == "drain" and e.n > 0:
                sim.draining.add(e.engine_id)
            else:
                sim.load_weights(e)
            sim.wake(e)
        share = sim.sys.push_share if sim.version > 1 else 1.0  # the first push is whole
        sync_s = sim.cm.weight_sync_s(cross_node=True, share=share, copies=sim.sys.push_copies)
        self.pushes.append(sync_s)
        sim.push(sim.now + sync_s, SYNC_DONE, "async")

    def on_sync_done(self, what: str) -> None:
        sim = self.sim
        if what == "to_train":
            self.meter.set("train_busy", sim.now)
            return
        if what == "reclaim_due":
            if self.lend_state == "lent" and self.reclaim_due == sim.now:
                self.lend_or_reclaim()
            return
        if what == "reclaimed":  # ahead of the batch: the trainer waits for it with its GPUs
            self.lend_state = "training"
            self.meter.set("train_idle", sim.now)
            self.maybe_train()
            return
        if what == "to_rollout":
            self.meter.set(None, sim.now)
            for e in sim.engines.values():
                e.load_weights(sim.now, 0.0, sim.version)
                e.open(sim.now)
            self.admit_sync()
            return
        if what == "lend":
            self.lend_state = "lent"
            self.meter.set(None, sim.now)
            for e in self.lent:
                e.open(sim.now)
                e.load_weights(sim.now, 0.0, sim.version)
                sim.fill(e)
                sim.wake(e)
            self.maybe_train()
            return
        self.syncing = False
        self.meter.set("train_idle", sim.now)
        self.admit_async()
        self.maybe_train()

    def admit_sync(self) -> None:
        """A colocated rollout phase starts: turns stopped by the last step first (APRIL's
        prioritised resumption), then turns that came back from their tools meanwhile, then new
        groups up to the batch times the over-provision ratio, counting the groups carried."""
        sim = self.sim
        if not sim.sys.partial_rollout:
            sim.lives.admit(sim.B)
            return
        carried, self.carried = self.carried, []
        for tid in carried:
            if tid in sim.trajs:  # its group may have been dropped as too stale
                sim.start_turn(tid)
        for e in sim.engines.values():
            sim.fill(e)
            sim.wake(e)
        # AReaL's admission rule bounds it too: with v·B groups trained and the dropped ones
        # replaced, (v + η + 1)·B admitted means at most (η + 1)·B in flight.
        target = min(math.ceil(sim.sys.partial_rollout * sim.B), self.bound.in_flight_limit(sim.B))
        sim.lives.admit(max(0, target - len(sim.groups)))

    def admit_async(self) -> None:
        """Bounded staleness at admission (AReaL's rule): at most (version + staleness + 1) batches
        admitted, not counting groups that were dropped as too stale."""
        sim = self.sim
        allowed = self.bound.launch_limit(sim.version, sim.B, sim.dropped_groups)
        if sim.sys.job_groups is not None:
            allowed = min(allowed, sim.sys.job_groups + sim.dropped_groups)
        if sim.admitted_groups < allowed:
            sim.lives.admit(allowed - sim.admitted_groups)
