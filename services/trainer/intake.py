"""Completed trajectories in: each delivery from the TRAJ stream is admitted into a group, or
settled with its group's one outcome (failed, stale, filtered, duplicate, invalid) published for
the scheduler's feed. A delivery is acked only when its fate is final; this trainer's held ones are
kept alive, and handed back (nak) when it stops stepping."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from nats.aio.msg import Msg

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.errors import InvalidMessage
from services.common.logging import get_logger
from services.common.ownership import OwnershipStore, trained_key
from services.common.runconfig import TrainingConfig
from services.common.streams import FEED_ACK_WAIT_S, TRAINER_FEED
from services.common.tracing import extract_context
from services.learning.data import validate
from services.trainer.batcher import GroupBuffer, Pending
from services.trainer.config import TrainerSettings

if TYPE_CHECKING:
    from services.learning.learner import Learner


T = TypeVar("T")

PREFETCH_WAIT_S = 0.1
"""How long one fetch during a step waits for a delivery: the most a step's end waits for it."""


async def settle(op: Any) -> None:
    """Acks/naks/terms a delivery; a failure only means JetStream redelivers it, which dedupe absorbs."""
    with contextlib.suppress(Exception):
        await op


class Intake:
    def __init__(
        self,
        run_id: str,
        training: TrainingConfig,
        group_size: int,
        drop_zero_advantage: bool,
        settings: TrainerSettings,
        bus: Bus,
        store: OwnershipStore,
        learner: Learner,
    ):
        self.run_id, self.training, self.settings = run_id, training, settings
        self.group_size, self.drop_zero_advantage = group_size, drop_zero_advantage
        self.bus, self.store, self.learner = bus, store, learner
        self.log = get_logger(component="trainer")
        self.group_complete: Callable[[str, float], None] | None = None
        """Told of each group the moment this trainer holds all of it (id, when it completed)."""
        self.psub: Any = None
        self.ack_wait_s = FEED_ACK_WAIT_S
        """The feed's ack wait as provisioned: a dead trainer's deliveries come back this fast;
        the live trainer marks what it holds in progress every third of it."""
        self.buffer: GroupBuffer[Msg] = GroupBuffer(training.max_staleness)
        self.decided: OrderedDict[str, None] = OrderedDict()
        self.stepping: list[Pending[Msg]] = []
        """The deliveries of the step being trained."""
        self.counts = {"trained": 0, "duplicate": 0, "stale": 0, "invalid": 0, "failed": 0, "filtered": 0}
        self.filtered_this_step = 0
        """Zero-advantage groups filtered since the last committed step (training.filter_budget)."""
        self.filtered_rewards: list[float] = []
        """...and their trajectories' rewards (the step's sampled reward counts them)."""

    @property
    def version(self) -> int:
        return self.learner.state.version

    async def open(self) -> None:
        await self.bus.bind_stream("GROUPS")  # where group outcomes go
        self.psub, self.ack_wait_s = await self.bus.bind_consumer(TRAINER_FEED)

    async def fetch(self, timeout_s: float | None = None) -> list[tuple[ev.CompletedTrajectory, Msg]]:
        """Deliveries waiting for this trainer, waiting up to `timeout_s` (idle_poll_s) for one."""
        timeout = self.settings.idle_poll_s if timeout_s is None else timeout_s
        return await self.bus.fetch(self.psub, ev.CompletedTrajectory, self.settings.fetch_batch, timeout)

    async def while_stepping(self, step: Awaitable[T], need: int) -> T:
        """Awaits `step` (a training step, off the event loop), meanwhile fetching and admitting
        deliveries until the buffer holds `need` complete groups: the next batch is decoded,
        checked and grouped while this one trains, not after it (at 512 trajectories a step, tens
        of seconds of this machine's time). What is admitted is settled as between steps: a
        trajectory trained only in a later step is acked when that step commits."""
        work = asyncio.ensure_future(step)
        try:
            while not work.done() and self.groups_complete() < need:
                try:
                    await self.admit(await self.fetch(timeout_s=PREFETCH_WAIT_S))
                except Exception as err:  # NATS reconnecting: the loop fetches after the step
                    self.log.warning("prefetch_failed", error=f"{type(err).__name__}: {err}")
                    break
        except asyncio.CancelledError:  # as a cancelled await of the step itself
            work.cancel()
            raise
        return await work

    async def keep_deliveries(self) -> None:
        """Tells JetStream that every delivery this trainer holds (buffered, or in the step being
        trained) is still being worked on, so only a dead trainer's deliveries are redelivered."""
        while True:
            await asyncio.sleep(self.ack_wait_s / 3)
            held = [p for g in self.buffer.groups.values() for p in g.values()] + self.stepping
            for p in held:
                for h in p.handles:
                    await settle(h.in_progress())

    async def admit(self, fetched: list[tuple[ev.CompletedTrajectory, Msg]]) -> None:
        if not fetched:
            return
        in_redis = await self._known_in_redis([t.trajectory_id for t, _ in fetched])
        stepping = {p.traj.trajectory_id: p for p in self.stepping}
        for (traj, raw), known in zip(fetched, in_redis, strict=True):
            tid = traj.trajectory_id
            if tid in stepping:  # delivered again while its step trains: settled with that step
                stepping[tid].handles.append(raw)
                continue
            if traj.HasField("failure") and traj.failure.code and traj.group_id:
                self.counts["failed"] += 1
                self.log.info("trajectory_failed", trajectory_id=tid, code=traj.failure.code)
                await self._drop_group(traj.group_id, "failed", f"{tid}: {traj.failure.message}", [raw])
                continue
            try:
                validate(traj, self.learner.vocab_size, self.version)
            except InvalidMessage as err:
                self.counts["invalid"] += 1
                await self.bus.report_error(raw.subject, err.code, f"trajectory {tid!r}: {err}")
                if traj.group_id and traj.trajectory_id:
                    # only the scheduler publishes trajectories: one it sent that cannot be trained
                    # fails its group visibly (the feed replaces it), never leaving it waiting
                    await self._drop_group(traj.group_id, "invalid", f"{tid}: {err}", [raw])
                else:
                    await settle(raw.term())
                continue
            if known or tid in self.learner.state.trained_ids:
                self.counts["duplicate"] += 1
                self.log.info("trajectory_duplicate", trajectory_id=tid)
                self._reannounce(traj)
                await settle(raw.ack())
                continue
            adm = self.buffer.add(traj, raw, self.version, extract_context(raw.headers))
            if adm.outcome == "stale":
                await self.drop_stale(adm.released)
            elif adm.outcome == "buffered" and self.group_complete is not None:
                members = self.buffer.groups[traj.group_id]
                if len(members) >= traj.group_size:
                    at = max(p.traj.completed_at for p in members.values()) or time.time()
                    self.group_complete(traj.group_id, at)

    async def _known_in_redis(self, ids: list[str]) -> list[bool]:
        try:
            found = await self.store.r.smismember(trained_key(self.run_id), ids)
            return [bool(x) for x in found]
        except Exception as err:  # the checkpoint's ids still guard against retraining
            self.log.warning("trained_set_unavailable", error=str(err))
            return [False] * len(ids)

    async def _drop_group(self, group_id: str, outcome: str, reason: str, extra: list[Msg]) -> None:
        """Drops a group that cannot be trained (acking what arrived of it) and reports its outcome."""
        dropped = self.buffer.drop(group_id)
        for p in dropped:
            for h in p.handles:
                await settle(h.ack())
        for raw in extra:
            await settle(raw.ack())
        await self.outcome(group_id, outcome, reason, len(dropped) + len(extra))

    async def outcome(
        self,
        group_id: str,
        outcome: str,
        reason: str = "",
        members: int = 0,
        trained_ids: list[str] | None = None,
    ) -> None:
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
            trained_ids=trained_ids or [],
        )
        self.log.info("group_outcome", group_id=group_id, outcome=outcome, reason=reason[:200])
        self.bus.spawn(self._publish_outcome(msg, f"{msg.group_id}:{msg.outcome}"))

    def _reannounce(self, traj: ev.CompletedTrajectory) -> None:
        """A member the job already trained, delivered again (a trainer that committed a step and
        died before its outcomes went out, or the scheduler re-sending after a restart): its group's
        `trained` outcome goes out again naming it, so the scheduler's ledger hears of every trained
        trajectory and the group does not stay open. The scheduler ignores a repeated decision."""
        if not traj.group_id:
            return
        msg = ev.GroupOutcome(
            group_id=traj.group_id,
            outcome="trained",
            reason="already committed",
            trajectories=1,
            weight_version=self.version,
            trained_ids=[traj.trajectory_id],
        )
        self.bus.spawn(self._publish_outcome(msg, f"{traj.group_id}:trained:{traj.trajectory_id}"))

    async def _publish_outcome(self, msg: ev.GroupOutcome, msg_id: str) -> None:
        """Until JetStream has it (the feed replaces a group only on its outcome); in the background,
        so a NATS outage does not stop training. The msg id makes every resend safe."""
        await self.bus.publish_durable_until_stored(subjects.GROUP_OUTCOME, msg, msg_id=msg_id)

    async def drop_stale(self, pendings: list[Pending[Msg]]) -> None:
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
                await settle(h.ack())
        for gid, members in groups.items():
            await self.outcome(gid, "stale", f"older than max_staleness at version {self.version}", members)

    async def filter_uninformative(self) -> None:
        """Drops complete zero-advantage groups within this step's budget (the feed replaces them)."""
        if not self.drop_zero_advantage:
            return
        left = self.training.filter_limit - self.filtered_this_step
        for group in self.buffer.filter_uninformative(max(0, left)):
            self.filtered_this_step += 1
            self.counts["filtered"] += len(group)
            self.filtered_rewards.extend(p.traj.reward for p in group)
            for p in group:
                for h in p.handles:
                    await settle(h.ack())
            first = group[0].traj
            await self.outcome(
                first.group_id, "filtered", f"all {len(group)} rewards equal ({first.reward:g})", len(group)
            )

    async def take(self) -> list[list[Pending[Msg]]]:
        """The next step's groups (none: not enough complete); the too-stale are dropped."""
        groups, stale = self.buffer.take(self.training.groups_per_step, self.version)
        await self.drop_stale(stale)
        return groups

    async def trained(self, groups: list[list[Pending[Msg]]]) -> tuple[int, list[float]]:
        """The step committed: its groups' outcomes out, its deliveries acked. Returns the groups
        filtered during the step and the rewards of every trajectory it sampled."""
        filtered, self.filtered_this_step = self.filtered_this_step, 0
        pendings = [p for g in groups for p in g]
        sampled = [p.traj.reward for p in pendings] + self.filtered_rewards
        self.filtered_rewards = []
        for g in groups:
            ids = [p.traj.trajectory_id for p in g]
            await self.outcome(g[0].traj.group_id, "trained", members=len(g), trained_ids=ids)
        for p in pendings:
            for h in p.handles:
                await settle(h.ack())
        self.counts["trained"] += len(pendings)
        return filtered, sampled

    async def hand_back(self, pendings: list[Pending[Msg]]) -> None:
        """Naks un-trained deliveries so JetStream redelivers them now rather than after ack_wait."""
        for p in pendings:
            for h in p.handles:
                await settle(h.nak())

    def groups_complete(self) -> int:
        """Complete groups this trainer holds (fetched)."""
        return sum(have >= size for _, have, size in self.buffer.waiting())

    async def groups_ready(self) -> int:
        """Complete groups this trainer could step on next: those buffered, plus what waits in
        JetStream undelivered (whole groups, roughly: their members complete close together). The
        planner's hybrid pool reads it as "training is the bottleneck" when it covers a step."""
        buffered = self.groups_complete()
        try:
            pending = int((await self.psub.consumer_info()).num_pending or 0)
        except Exception:  # NATS away: the buffer alone
            pending = 0
        return buffered + pending // max(1, self.group_size)
