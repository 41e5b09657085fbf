"""The trainer service shell: trajectories from JetStream in, GRPO steps, weights out to every engine.

Exactly once by trajectory id: a step's trajectories are acked only after its checkpoint (which lists
their ids) is written and the ids are in the Redis set `libra:{run}:trained`; any delivery of an id
already in either is acked and skipped. A crash before the commit loses nothing (the deliveries come
back); a crash after it trains nothing twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg
from opentelemetry import trace

from services.common import control, subjects
from services.common.bus import Bus
from services.common.config import CommonSettings, load_settings
from services.common.contracts import ev
from services.common.errors import DurableStateLost, InvalidMessage
from services.common.logging import get_logger
from services.common.membership import SERVING_ROLES, TRAINER_ROLE, Membership
from services.common.metrics import trainer_metrics
from services.common.ownership import OwnershipStore, trained_key
from services.common.runconfig import RunConfig
from services.common.tasks import retry_pause
from services.common.tracing import extract_context, tracer
from services.learning.data import to_sample, validate
from services.learning.snapshot import Snapshot
from services.trainer.batcher import GroupBuffer, Pending
from services.trainer.config import TrainerSettings
from services.trainer.hybrid_host import HybridHost
from services.trainer.weight_push import PushResult, WeightPusher

if TYPE_CHECKING:
    from services.learning.learner import Learner
    from services.learning.step import StepStats


class TrainerService:
    def __init__(
        self,
        common: CommonSettings,
        settings: TrainerSettings,
        run: RunConfig,
        learner: Learner,
        bus: Bus,
        store: OwnershipStore,
        membership: Membership,
        pusher: WeightPusher,
    ):
        self.common = common
        self.settings = settings
        self.run = run
        self.learner = learner
        self.bus = bus
        self.store = store
        self.membership = membership
        self.pusher = pusher
        self.buffer: GroupBuffer[Msg] = GroupBuffer(run.training.max_staleness)
        self.log = get_logger(component="trainer")
        self.psub: Any = None
        self.snap: Snapshot | None = None
        """The current version's weights as pushed (taken right after its commit)."""
        self.base: Snapshot | None = None
        """The last version engines took: sparse deltas are taken from it."""
        self._want_push = asyncio.Event()
        self._pushing = asyncio.Lock()
        self._push_parent: Any = None
        """The trace context of the step whose version the next push carries (None: a resync)."""
        self.synced: dict[str, int] = {}
        self.last_metrics: ev.TrainMetrics | None = None
        self.done_published = False
        self._last_resync = float("-inf")
        self._leader: bool | None = None
        self._epoch = -1
        """The fencing token under which this trainer last adopted the commit record."""
        self.decided: OrderedDict[str, None] = OrderedDict()
        self.stepping: list[Pending[Msg]] = []
        self.counts = {"trained": 0, "duplicate": 0, "stale": 0, "invalid": 0, "failed": 0, "filtered": 0}
        self.filtered_this_step = 0
        """Zero-advantage groups filtered since the last committed step (training.filter_budget)."""
        self.filtered_rewards: list[float] = []
        """...and their trajectories' rewards (the step's sampled reward counts them)."""
        emulated = run.training.backend == "emulated"
        self.hybrid = HybridHost(
            settings,
            bus,
            store,
            membership,
            lambda: learner.model,
            unsupported=(
                "an emulated trainer has no gradients to share"
                if emulated
                else "a sharded (FSDP) trainer does not take hybrid workers yet"
                if run.training.fsdp > 1
                else ""
            ),
        )

    @property
    def version(self) -> int:
        return self.learner.state.version

    @property
    def finished(self) -> bool:
        return self.learner.state.step >= self.run.training.steps

    async def open_consumer(self) -> None:
        await self.bus.ensure_stream("GROUPS", [subjects.GROUP_OUTCOME])
        stream = await self.bus.ensure_stream("TRAJ", [subjects.TRAJ_COMPLETED])
        self.psub = await self.bus.pull_consumer(
            subjects.TRAJ_COMPLETED, durable="trainer", stream=stream, ack_wait_s=self.settings.ack_wait_s
        )

    async def run_until(self, stop: asyncio.Event) -> None:
        if not await self._await_assignment(stop):
            return
        self.bus.spawn(self._keep_deliveries())
        self.bus.spawn(self._push_loop())
        await self.hybrid.start()
        try:
            while not stop.is_set():
                if not self.finished:
                    await self._train_once(stop)
                else:
                    await self._hand_back(self.buffer.drain())
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.settings.idle_poll_s)
                if not stop.is_set():
                    await self._resync()
                    await self._step_boundary()
        finally:
            await self._hand_back(self.buffer.drain())
            await self.hybrid.close()

    async def _keep_deliveries(self) -> None:
        """Tells JetStream that every delivery this trainer holds (buffered, or in the step being
        trained) is still being worked on, so only a dead trainer's deliveries are redelivered."""
        while True:
            await asyncio.sleep(self.settings.ack_wait_s / 3)
            held = [p for g in self.buffer.groups.values() for p in g.values()] + self.stepping
            for p in held:
                for h in p.handles:
                    await _settle(h.in_progress())

    async def _await_assignment(self, stop: asyncio.Event) -> bool:
        waited = 0.0
        self._show_progress(assigned=False)
        while not stop.is_set():
            a = self.membership.assignment
            if a is not None and a.role == "train":
                self.log.info("trainer_assigned", fencing_token=a.fencing_token)
                self._show_progress()
                return True
            await asyncio.sleep(0.2)
            waited += 0.2
            if waited >= self.settings.assignment_timeout_s:
                self.log.warning("waiting_for_assignment", waited_s=round(waited, 1))
                waited = 0.0
        return False

    def _fencing_token(self) -> int:
        a = self.membership.assignment
        return a.fencing_token if a is not None else 0

    async def _train_once(self, stop: asyncio.Event) -> None:
        if not self.membership.holds_lease() or not await self._lease_current():
            await self._hand_back(self.buffer.drain())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.idle_poll_s)
            return
        token = self._fencing_token()
        if token != self._epoch:  # a new epoch (first assignment, a restart, a takeover)
            if not await self._adopt_committed(stop):
                return
            self._epoch = token
        try:
            fetched = await self.bus.fetch(
                self.psub, ev.CompletedTrajectory, self.settings.fetch_batch, self.settings.idle_poll_s
            )
        except Exception as err:  # NATS reconnecting: what is buffered stays, deliveries come back
            self.log.warning("fetch_failed", error=f"{type(err).__name__}: {err}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.idle_poll_s)
            return
        await self._admit(fetched)
        while not self.finished and not stop.is_set():
            await self._filter_uninformative()
            groups, stale = self.buffer.take(self.run.training.groups_per_step, self.version)
            await self._drop_stale(stale)
            if not groups:
                break
            await self._step_boundary()  # hybrid workers join and leave between two steps
            await self._step(groups, stop)
        self._show_progress()

    async def _step_boundary(self) -> None:
        leading = bool(self._leader) and self._epoch == self._fencing_token()
        await self.hybrid.tick(leading and not self.finished, self._fencing_token())

    def _show_progress(self, assigned: bool = True) -> None:
        """What a watcher of the job sees of this trainer (the stall report's trainer section)."""
        waiting = self.buffer.waiting()
        control.set_detail(
            assigned=assigned,
            step=self.learner.state.step,
            weight_version=self.version,
            groups_buffered=len(waiting),
            groups_complete=sum(have >= size for _, have, size in waiting),
            waiting_groups=", ".join(f"{g} {have}/{size}" for g, have, size in waiting[:10]),
            **{f"trajectories_{k}": v for k, v in self.counts.items()},
        )

    async def _lease_current(self) -> bool:
        try:
            ok = await self.store.is_current(TRAINER_ROLE, self._fencing_token())
        except Exception as err:  # Redis unreachable: keep the loop alive, try again next round
            self.log.warning("lease_check_failed", error=str(err))
            return False
        if ok != self._leader:
            self.log.log(
                20 if ok else 30,
                "lease_current" if ok else "lease_not_current",
                fencing_token=self._fencing_token(),
            )
            self._leader = ok
        return ok

    async def _admit(self, fetched: list[tuple[ev.CompletedTrajectory, Msg]]) -> None:
        if not fetched:
            return
        in_redis = await self._known_in_redis([t.trajectory_id for t, _ in fetched])
        for (traj, raw), known in zip(fetched, in_redis, strict=True):
            tid = traj.trajectory_id
            if traj.HasField("failure") and traj.failure.code and traj.group_id:
                self.counts["failed"] += 1
                self.log.info("trajectory_failed", trajectory_id=tid, code=traj.failure.code)
                await self._drop_group(traj.group_id, "failed", f"{tid}: {traj.failure.message}", [raw])
                continue
            try:
                validate(traj, self.learner.vocab_size)
            except InvalidMessage as err:
                self.counts["invalid"] += 1
                await self.bus.report_error(raw.subject, err.code, f"trajectory {tid!r}: {err}")
                await _settle(raw.term())  # changes nothing else: a forged one must not cost a real group
                continue
            if known or tid in self.learner.state.trained_ids:
                self.counts["duplicate"] += 1
                self.log.info("trajectory_duplicate", trajectory_id=tid)
                await _settle(raw.ack())
                continue
            adm = self.buffer.add(traj, raw, self.version, extract_context(raw.headers))
            if adm.outcome == "stale":
                await self._drop_stale(adm.released)

    async def _known_in_redis(self, ids: list[str]) -> list[bool]:
        try:
            found = await self.store.r.smismember(trained_key(self.common.run_id), ids)
            return [bool(x) for x in found]
        except Exception as err:  # the checkpoint's ids still guard against retraining
            self.log.warning("trained_set_unavailable", error=str(err))
            return [False] * len(ids)

    async def _drop_group(self, group_id: str, outcome: str, reason: str, extra: list[Msg]) -> None:
        """Drops a group that cannot be trained (acking what arrived of it) and reports its outcome."""
        dropped = self.buffer.drop(group_id)
        for p in dropped:
            for h in p.handles:
                await _settle(h.ack())
        for raw in extra:
            await _settle(raw.ack())
        await self._outcome(group_id, outcome, reason, len(dropped) + len(extra))

    async def _outcome(self, group_id: str, outcome: str, reason: str = "", members: int = 0) -> None:
        """Publishes a group's one outcome; later members of a decided group change nothing."""
        if group_id in self.decided:
            return
        self.decided[group_id] = None
        while len(self.decided) > 100_000:
            self.decided.popitem(last=False)
        msg = ev.GroupOutcome(
            group_id=group_id,
            outcome=outcome,
            reason=reason[:500],
            trajectories=members,
            weight_version=self.version,
            train_step=self.learner.state.step if outcome == "trained" else 0,
        )
        self.log.info("group_outcome", group_id=group_id, outcome=outcome, reason=reason[:200])
        self.bus.spawn(self._publish_outcome(msg))

    async def _publish_outcome(self, msg: ev.GroupOutcome) -> None:
        """Until JetStream has it (the feed replaces a group only on its outcome); in the background,
        so a NATS outage does not stop training. The msg id makes every resend safe."""
        await self.bus.publish_durable_until_stored(
            subjects.GROUP_OUTCOME, msg, msg_id=f"{msg.group_id}:{msg.outcome}"
        )

    async def _drop_stale(self, pendings: list[Pending[Msg]]) -> None:
        groups: dict[str, int] = {}
        for p in pendings:
            groups[p.traj.group_id] = groups.get(p.traj.group_id, 0) + 1
            self.counts["stale"] += 1
            self.log.info(
                "trajectory_stale",
                trajectory_id=p.traj.trajectory_id,
                policy_version=p.traj.min_policy_version,
                weight_version=self.version,
            )
            for h in p.handles:
                await _settle(h.ack())
        for gid, members in groups.items():
            await self._outcome(gid, "stale", f"older than max_staleness at version {self.version}", members)

    async def _filter_uninformative(self) -> None:
        """Drops complete zero-advantage groups within this step's budget (the feed replaces them)."""
        if not self.run.filters_zero_advantage:
            return
        left = self.run.training.filter_limit - self.filtered_this_step
        for group in self.buffer.filter_uninformative(max(0, left)):
            self.filtered_this_step += 1
            self.counts["filtered"] += len(group)
            self.filtered_rewards.extend(p.traj.reward for p in group)
            for p in group:
                for h in p.handles:
                    await _settle(h.ack())
            first = group[0].traj
            await self._outcome(
                first.group_id, "filtered", f"all {len(group)} rewards equal ({first.reward:g})", len(group)
            )

    async def _hand_back(self, pendings: list[Pending[Msg]]) -> None:
        """Naks un-trained deliveries so JetStream redelivers them now rather than after ack_wait."""
        for p in pendings:
            for h in p.handles:
                await _settle(h.nak())

    async def _step(self, groups: list[list[Pending[Msg]]], stop: asyncio.Event) -> None:

        pendings = [p for g in groups for p in g]
        self.stepping = pendings
        try:
            await self._step_groups(groups, pendings, stop)
        finally:
            self.stepping = []

    async def _step_groups(
        self, groups: list[list[Pending[Msg]]], pendings: list[Pending[Msg]], stop: asyncio.Event
    ) -> None:
        from services.learning.step import StepAborted  # torch: loaded by now, with the learner

        links = []
        for p in pendings:
            sc = trace.get_current_span(p.context).get_span_context()
            if sc.is_valid:
                links.append(trace.Link(sc, {"libra.trajectory_id": p.traj.trajectory_id}))
        ids = {p.traj.trajectory_id for p in pendings}
        attrs = {"libra.train_step": self.learner.state.step + 1, "libra.trajectories": len(pendings)}
        with tracer().start_as_current_span("train.step", links=links, attributes=attrs) as span:
            samples = [to_sample(p.traj) for p in pendings]
            try:
                group = self.hybrid.group if self.hybrid.members else None
                stats = await asyncio.to_thread(self.learner.step, samples, stop.is_set, group)
                self.hybrid.stepped(self.learner.group_error)
                path = await asyncio.to_thread(self.learner.commit, ids, self._fencing_token())
            except StepAborted:
                self.log.info("train_step_abandoned", trajectories=len(pendings))
                await self._hand_back(pendings)
                return
            except BaseException:
                await self._hand_back(pendings)
                raise
            if not await self._record_commit(ids, str(path), stop):
                await self._hand_back(pendings)
                await self._roll_back()
                return
            filtered, self.filtered_this_step = self.filtered_this_step, 0
            sampled = [p.traj.reward for p in pendings] + self.filtered_rewards
            self.filtered_rewards = []
            for g in groups:
                await self._outcome(g[0].traj.group_id, "trained", members=len(g))
            for p in pendings:
                for h in p.handles:
                    await _settle(h.ack())
            self.counts["trained"] += len(pendings)
            every = self.run.training.save_every
            if every and self.learner.state.step % every == 0 and self.run.training.backend != "emulated":
                saved = await asyncio.to_thread(self.learner.save_policy, self.common.run_id)
                self.log.info("policy_saved", step=self.learner.state.step, path=str(saved))
            span.set_attribute("libra.weight_version", self.version)
            span.set_attribute("libra.data_parallel", stats.data_parallel)
            self._trace_into_trajectories(span, pendings)
            self.log.info(
                "train_step",
                step=self.learner.state.step,
                policy_version=self.version,
                loss=round(stats.loss, 6),
                tokens=stats.tokens,
                step_s=round(stats.seconds, 3),
                kl=round(stats.kl, 6),
                clip_fraction=round(stats.clip_fraction, 4),
                grad_norm=round(stats.grad_norm, 4),
                entropy=round(stats.entropy, 4),
                is_weight_mean=round(stats.is_weight_mean, 4),
                logprob_mismatch=stats.logprob_mismatch,
                lr=stats.lr,
                groups_filtered=filtered,
                policy_versions=list(stats.policy_versions),
                data_parallel=stats.data_parallel,
            )
            # the push streams in the background while the next step trains; the snapshot is
            # taken first, so the step cannot change what is being pushed
            self.snap = await asyncio.to_thread(self.learner.snapshot)
            if not stop.is_set():
                self._push_parent = trace.set_span_in_context(span)  # weights.push: a child of this step
                self._want_push.set()
        await self._publish_step(stats, 0.0, 0, filtered, sampled)

    async def _roll_back(self, record: dict[str, str] | None = None) -> None:
        """Back to (or, for a standby taking over, on to) the step the job's commit record holds."""
        try:
            record = record if record is not None else await self.store.committed()
        except Exception as err:
            self.log.error("rollback_failed", error=str(err))
            return
        step, named = int(record.get("step", 0)), record.get("checkpoint", "")
        await self.hybrid.close()  # its members hold weights this trainer is about to drop
        path = await asyncio.to_thread(self.learner.rollback, step, named)
        self.snap = self.base = None
        self.log.warning(
            "rolled_back", step=self.learner.state.step, checkpoint=str(path or "initial weights")
        )

    async def _adopt_committed(self, stop: asyncio.Event) -> bool:
        """The job's progress is the commit record's: a trainer that starts, restarts or takes over
        from another loads the checkpoint the record names unless that is what it holds (checkpoints
        the record does not cover are not the job's). Waits out a Redis outage; False if stopped."""
        attempt = 0
        record: dict[str, str] | None = None
        while record is None:
            if stop.is_set():
                return False
            try:
                record = await self.store.committed()
            except Exception as err:
                attempt += 1
                self.log.warning("commit_record_unreadable", error=str(err), attempt=attempt)
                await retry_pause(attempt)
        step, named = int(record.get("step", 0)), record.get("checkpoint", "")
        if step > 0 and named and not Path(named).exists():
            raise DurableStateLost(
                f"the commit record says step {step} is committed in {named}, which is not there (the "
                "checkpoint directory was lost, or is not shared with this trainer): not training on "
                "from older weights"
            )
        holds = self.learner.state.step == step and (
            not named or (self.learner.loaded is not None and str(self.learner.loaded) == named)
        )
        if not holds:
            await self._roll_back(record)
        return True

    async def _record_commit(self, ids: set[str], checkpoint: str, stop: asyncio.Event | None = None) -> bool:
        """Records the committed step in Redis (the job's authoritative progress) under the lease.

        False when the lease moved on: this trainer must not ack what it trained. Redis away is
        waited out (with a backoff of at most 5 s): nothing is acked before the record holds the
        step; stopping meanwhile counts as not committed, and the step is rolled back.
        """
        state = self.learner.state
        token = self._fencing_token()
        record: dict[str, str | int] = {
            "step": state.step,
            "version": state.version,
            "checkpoint": checkpoint,
            "trained": len(state.trained_ids),
            "worker_id": self.bus.worker_id,
            "fencing_token": token,
        }
        attempt = 0
        while True:
            try:
                if attempt and await self._already_committed(state.step, token):
                    return True  # the earlier attempt reached Redis; only its answer was lost
                ok = await self.store.fenced_commit(TRAINER_ROLE, token, record, ids)
                break
            except Exception as err:
                attempt += 1
                self.log.warning("commit_record_failed", error=str(err), attempt=attempt)
                if stop is not None and stop.is_set():
                    return False
                await retry_pause(attempt)
        if not ok:
            self.log.error("commit_refused", step=state.step, fencing_token=token, reason="lease lost")
        return ok

    async def _already_committed(self, step: int, token: int) -> bool:
        record = await self.store.committed()
        return record.get("step") == str(step) and record.get("fencing_token") == str(token)

    async def _push_loop(self) -> None:
        """Pushes the newest version to the engines that lack it whenever asked (after a commit,
        or by the resync); one push at a time, and a version superseded while waiting is skipped."""
        while True:
            await self._want_push.wait()
            self._want_push.clear()
            try:
                await self._push_current(only_missing=True)
            except Exception:  # a push must never end the loop: the resync asks again
                self.log.exception("weights_push_error")

    async def _push_current(self, only_missing: bool = False) -> tuple[float, int, dict[str, PushResult]]:
        """Pushes the current version to the plan's engines (or those lacking it) under `weights.push`."""
        if not self._leader or self._epoch != self._fencing_token():
            return 0.0, 0, {}
        addrs = [a.weight_sync_addr for a in self.membership.peers(*SERVING_ROLES) if a.weight_sync_addr]
        if only_missing:
            addrs = [a for a in addrs if self.synced.get(a) != self.version]
        if not addrs or self.version == 0:
            return 0.0, 0, {}
        async with self._pushing:
            if self.snap is None or self.snap.version != self.version:
                self.snap = await asyncio.to_thread(self.learner.snapshot)
            snap = self.snap
            base = self.base if self.run.training.push_delta and self.base is not None else None
            parent, self._push_parent = self._push_parent, None
            with tracer().start_as_current_span("weights.push", context=parent) as span:
                start = time.perf_counter()
                results = await self.pusher.push(snap, self._fencing_token(), addrs, base)
                seconds = time.perf_counter() - start
                for addr, r in results.items():
                    if r.in_sync:
                        self.synced[addr] = snap.version
                if any(r.in_sync for r in results.values()):
                    self.base = snap
                cost = self.pusher.last
                span.set_attribute("libra.weight_version", snap.version)
                span.set_attribute("libra.push_bytes", cost.uploaded)
                span.set_attribute("libra.delta_bytes", cost.delta_bytes)
                span.set_attribute("libra.engines_in_sync", sum(r.in_sync for r in results.values()))
        trainer_metrics().push_seconds.observe(seconds)
        trainer_metrics().push_bytes.inc(cost.uploaded)
        self.log.info(
            "weights_pushed",
            policy_version=snap.version,
            engines=len(addrs),
            in_sync=sum(r.in_sync for r in results.values()),
            size_bytes=snap.nbytes,
            uploaded_bytes=cost.uploaded,
            delta_bytes=cost.delta_bytes,
            delta_engines=cost.delta_engines,
            push_s=round(seconds, 3),
        )
        applied = sorted(a for a, r in results.items() if r.in_sync and r.code != "stale_version")
        if applied:
            await self.bus.publish(
                subjects.WEIGHTS_UPDATED,
                ev.WeightsUpdated(
                    version=snap.version,
                    checksum=snap.checksum,
                    size_bytes=snap.nbytes,
                    push_s=seconds,
                    engines=applied,
                    train_step=self.learner.state.step,
                    uploaded_bytes=cost.uploaded,
                    delta_bytes=cost.delta_bytes,
                    delta_engines=cost.delta_engines,
                    dtype=snap.dtype,
                    relayed_engines=sum(1 for a in applied if results[a].via),
                ),
            )
        return seconds, cost.uploaded, results

    def _all_engines_synced(self) -> bool:
        addrs = [a.weight_sync_addr for a in self.membership.peers(*SERVING_ROLES) if a.weight_sync_addr]
        return all(self.synced.get(a) == self.version for a in addrs)

    async def _publish_step(
        self, stats: StepStats, push_s: float, push_bytes: int, filtered: int, sampled: list[float]
    ) -> None:
        done = self.finished and self._all_engines_synced()
        self.last_metrics = ev.TrainMetrics(
            step=self.learner.state.step,
            weight_version=self.version,
            loss=stats.loss,
            reward_mean=stats.reward_mean,
            reward_std=stats.reward_std,
            trajectories=stats.trajectories,
            tokens=stats.tokens,
            step_s=stats.seconds,
            kl=stats.kl,
            clip_fraction=stats.clip_fraction,
            push_s=push_s,
            push_bytes=push_bytes,
            done=done,
            data_parallel=stats.data_parallel,
            groups_ready=await self._groups_ready(),
            entropy=stats.entropy,
            is_weight_mean=stats.is_weight_mean,
            is_weight_max=stats.is_weight_max,
            is_truncated_fraction=stats.is_truncated_fraction,
            dual_clip_fraction=stats.dual_clip_fraction,
            logprob_mismatch=stats.logprob_mismatch,
            mismatch_tokens=stats.mismatch_tokens,
            lr=stats.lr,
            grad_norm=stats.grad_norm,
            groups_filtered=filtered,
            policy_versions=list(stats.policy_versions),
            stale_token_fraction=stats.stale_token_fraction,
            ref_kl=stats.ref_kl,
            sampled_reward_mean=statistics.fmean(sampled) if sampled else 0.0,
            sampled_reward_std=statistics.pstdev(sampled) if sampled else 0.0,
            sampled_trajectories=len(sampled),
        )
        await self.bus.publish(subjects.TRAIN_METRICS, self.last_metrics)
        m = trainer_metrics()
        m.steps.inc()
        m.step_seconds.observe(stats.seconds)
        m.weight_version.set(self.version)
        m.trajectories.inc(len(sampled))
        if sampled:
            m.reward.set(statistics.fmean(sampled))
        if done:
            self._announce_done()

    def _trace_into_trajectories(self, step_span: trace.Span, pendings: list[Pending[Msg]]) -> None:
        """The step in each trained trajectory's own trace too (a `train.step` child spanning the
        step, linked to the step's span), so one trace shows a trajectory from launch to the step
        that consumed it; the step's span links back to every trajectory."""
        start = getattr(step_span, "start_time", None)
        link = [trace.Link(step_span.get_span_context())]
        attrs = {"libra.train_step": self.learner.state.step, "libra.weight_version": self.version}
        for p in pendings:
            if trace.get_current_span(p.context).get_span_context().is_valid:
                child = tracer().start_span(
                    "train.step", context=p.context, links=link, attributes=attrs, start_time=start
                )
                child.end()

    async def _groups_ready(self) -> int:
        """Complete groups this trainer could step on next: those buffered, plus what waits in
        JetStream undelivered (whole groups, roughly: their members complete close together). The
        planner's hybrid pool reads it as "training is the bottleneck" when it covers a step."""
        buffered = sum(have >= size for _, have, size in self.buffer.waiting())
        try:
            pending = int((await self.psub.consumer_info()).num_pending or 0)
        except Exception:  # NATS away: the buffer alone
            pending = 0
        return buffered + pending // max(1, self.run.task.group_size)

    async def _resync(self) -> None:
        """Brings engines that lack the current weights up to date; then, if finished, announces done.
        Only the trainer holding the role does: a standby's weights are not the job's."""
        if not self._leader or self._epoch != self._fencing_token():
            return
        now = time.monotonic()
        if now - self._last_resync < self.settings.resync_interval_s:
            return
        self._last_resync = now
        if self.version > 0:
            # what the engines say, not what this trainer remembers pushing: an engine restarted at
            # the same address (a pod keeps its name and port) is back at version 0
            addrs = [a.weight_sync_addr for a in self.membership.peers(*SERVING_ROLES) if a.weight_sync_addr]
            self.synced.update(await self.pusher.versions(addrs))
            if not self._all_engines_synced():
                self._want_push.set()
        if self.finished and not self.done_published and self._all_engines_synced():
            final = ev.TrainMetrics()
            if self.last_metrics is not None:
                final.CopyFrom(self.last_metrics)
            final.step, final.weight_version, final.done = self.learner.state.step, self.version, True
            await self.bus.publish(subjects.TRAIN_METRICS, final)
            self._announce_done()

    def _announce_done(self) -> None:
        self.done_published = True
        self.log.info(
            "training_done", step=self.learner.state.step, policy_version=self.version, **self.counts
        )


async def _settle(op: Any) -> None:
    """Acks/naks/terms a delivery; a failure only means JetStream redelivers it, which dedupe absorbs."""
    with contextlib.suppress(Exception):
        await op


async def serve(
    common: CommonSettings, run: RunConfig, stop: asyncio.Event, stack: contextlib.AsyncExitStack
) -> None:
    settings = load_settings(TrainerSettings)
    log = get_logger(component="trainer")
    worker_id = common.worker_id or "trainer"

    from services.learning.checkpoint import checkpoint_dir
    from services.learning.learner import Learner

    ckpt_dir = checkpoint_dir(run.training.checkpoint_dir, common.run_id)
    learner = await asyncio.to_thread(Learner, run, ckpt_dir, settings.keep_checkpoints)
    stack.callback(learner.close)
    if settings.resume:
        path = await asyncio.to_thread(learner.resume)
        if path is not None:
            log.info(
                "checkpoint_resumed",
                path=str(path),
                step=learner.state.step,
                policy_version=learner.state.version,
                trained=len(learner.state.trained_ids),
            )

    store = OwnershipStore.from_url(common.redis_url, common.run_id, common.redis_secret(), common.tls())
    stack.push_async_callback(store.close)
    pusher = WeightPusher(
        worker_id,
        run.training.push_chunk_bytes,
        retries=settings.push_retries,
        backoff_s=settings.push_backoff_s,
        timeout_s=settings.push_timeout_s,
        token=common.grpc_token(),
        tls=common.tls(),
        fanout=run.training.push_fanout,
    )
    stack.push_async_callback(pusher.close)
    bus = await Bus.connect(
        common.nats_url, common.run_id, "trainer", worker_id, common.nats_auth(), common.nats_tls()
    )
    stack.push_async_callback(bus.close)
    membership = Membership(bus, store, ev.WorkerHello(worker_id=worker_id, kind="trainer"))
    await membership.start()

    service = TrainerService(common, settings, run, learner, bus, store, membership, pusher)
    await service.open_consumer()
    log.info("trainer_ready", step=learner.state.step, policy_version=learner.state.version)
    await service.run_until(stop)
