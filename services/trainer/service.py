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
from typing import TYPE_CHECKING, Any

from nats.aio.msg import Msg
from opentelemetry import trace

from services.common import control, lending, subjects
from services.common.bus import Bus
from services.common.config import CommonSettings, load_settings
from services.common.contracts import ev
from services.common.logging import get_logger
from services.common.membership import Membership
from services.common.metrics import trainer_metrics
from services.common.ownership import OwnershipStore
from services.common.runconfig import EngineJob, LearnJob, RunConfig, TrainingConfig
from services.common.tracing import tracer
from services.learning.data import to_samples
from services.trainer.batcher import Pending
from services.trainer.config import TrainerSettings
from services.trainer.distribution import WeightDistribution
from services.trainer.hybrid_host import HybridHost
from services.trainer.intake import Intake
from services.trainer.leadership import Leadership
from services.trainer.lending import Lender
from services.trainer.serving import TrainerEngine
from services.trainer.step_report import step_metrics, trace_into_trajectories
from services.trainer.weight_push import WeightPusher

if TYPE_CHECKING:
    from services.learning.learner import Learner
    from services.learning.step import StepStats


def hybrid_unsupported(training: TrainingConfig) -> str:
    """Why this trainer cannot take hybrid workers ("" where it can)."""
    if training.backend == "emulated":
        return "an emulated trainer has no gradients to share"
    if training.fsdp > 1:
        return "a sharded (FSDP) trainer does not take hybrid workers yet"
    if training.lora is not None:
        return "a LoRA trainer (training.lora) does not take hybrid workers yet"
    return ""


def log_step(log: Any, step: int, version: int, stats: StepStats, filtered: int) -> None:
    """A trained step, in the trainer's log."""
    log.info(
        "train_step",
        step=step,
        policy_version=version,
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


class TrainerService:
    """The exactly-once order of one step: take complete groups, train, checkpoint, fenced commit,
    ack, push. Deliveries in are the intake's (`intake.py`), the lease and the commit record the
    leadership's (`leadership.py`), weights out the distribution's (`distribution.py`)."""

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
        own_engine: TrainerEngine | None = None,
    ):
        self.common = common
        self.settings = settings
        self.run = run
        self.learner = learner
        self.bus = bus
        self.membership = membership
        self.log = get_logger(component="trainer")
        self.last_metrics: ev.TrainMetrics | None = None
        self.done_published = False
        self._last_resync = float("-inf")
        self.hybrid = HybridHost(
            settings,
            bus,
            store,
            membership,
            lambda: learner.model,
            unsupported=hybrid_unsupported(run.training),
        )
        self.intake = Intake(
            common.run_id,
            run.training,
            run.task.group_size,
            run.filters_zero_advantage,
            settings,
            bus,
            store,
            learner,
        )
        self.lead: Leadership = Leadership(
            bus,
            store,
            membership,
            learner,
            self.hybrid,
            rolled_back=lambda: self.weights.forget(),
            model_owned=own_engine.training if own_engine is not None else contextlib.nullcontext,
        )
        self.weights: WeightDistribution = WeightDistribution(
            run.training.push_delta,
            bus,
            membership,
            learner,
            pusher,
            lambda: self.lead.leading,
            lambda: self.lead.token,
        )
        self.lender = Lender(
            run.planner.lending,
            lending.switch_s(run),
            lending.lent_share(run),
            run.training.groups_per_step,
            bus,
            membership,
            lambda: self.lead.token,
            lambda: self.learner.state.step,
            self.weights.want_push,
            settings.lend_timeout_s,
        )
        self.intake.group_complete = self.lender.group_complete
        self.own_engine = own_engine
        """Its own engine, serving lent turns with the learner's model (planner.lending.trainer_serves)."""

    @property
    def version(self) -> int:
        return self.learner.state.version

    @property
    def finished(self) -> bool:
        return self.learner.state.step >= self.run.training.steps

    async def open_consumer(self) -> None:
        await self.intake.open()

    async def run_until(self, stop: asyncio.Event) -> None:
        if not await self._await_assignment(stop):
            return
        await self.lead.facts.start()
        self.bus.spawn(self.intake.keep_deliveries())
        self.bus.spawn(self.weights.push_loop())
        if self.lender.enabled:
            self.bus.spawn(self.lender.watch(self.intake.groups_complete))
        await self.hybrid.start()
        try:
            while not stop.is_set():
                if not self.finished:
                    await self._train_once(stop)
                else:
                    await self.intake.hand_back(self.intake.buffer.drain())
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), self.settings.idle_poll_s)
                if not stop.is_set():
                    await self._resync()
                    await self._step_boundary()
        finally:
            await self.intake.hand_back(self.intake.buffer.drain())
            await self.hybrid.close()

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

    async def _train_once(self, stop: asyncio.Event) -> None:
        if not await self.lead.holds():
            await self.intake.hand_back(self.intake.buffer.drain())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.idle_poll_s)
            return
        if not await self.lead.adopt(stop):
            return
        if self.intake.groups_complete() < self.run.training.groups_per_step:
            # the GPUs go to rollout before the trainer blocks on its next delivery, not after it
            # (a job's first batch: the whole first rollout)
            await self._wait_for_batch()
        try:
            fetched = await self.intake.fetch()
        except Exception as err:  # NATS reconnecting: what is buffered stays, deliveries come back
            self.log.warning("fetch_failed", error=f"{type(err).__name__}: {err}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.idle_poll_s)
            return
        await self.intake.admit(fetched)
        while not self.finished and not stop.is_set():
            await self.intake.filter_uninformative()
            groups = await self.intake.take()
            if not groups:
                await self._wait_for_batch()
                break
            await self.lender.reclaim()
            await self._step_boundary()  # hybrid workers join and leave between two steps
            async with self.own_engine.training() if self.own_engine else contextlib.nullcontext():
                await self._step(groups, stop)
        self._show_progress()

    async def _wait_for_batch(self) -> None:
        """No batch is complete with what has been fetched: with what JetStream holds for it now
        still none, the trainer waits for rollout, and lends its GPUs to it meanwhile."""
        if not self.lender.enabled or self.lender.lent_at is not None:
            return
        with contextlib.suppress(Exception):  # NATS reconnecting: the next fetch tries again
            await self.intake.admit(await self.intake.fetch(timeout_s=0.05))
            await self.intake.filter_uninformative()
        if await self.intake.groups_ready() < self.run.training.groups_per_step:
            await self.lender.waiting(self.intake.groups_complete())

    async def _step_boundary(self) -> None:
        await self.hybrid.tick(self.lead.leading and not self.finished, self.lead.token)

    def _show_progress(self, assigned: bool = True) -> None:
        """What a watcher of the job sees of this trainer (the stall report's trainer section)."""
        waiting = self.intake.buffer.waiting()
        control.set_detail(
            assigned=assigned,
            step=self.learner.state.step,
            weight_version=self.version,
            groups_buffered=len(waiting),
            groups_complete=sum(have >= size for _, have, size in waiting),
            waiting_groups=", ".join(f"{g} {have}/{size}" for g, have, size in waiting[:10]),
            **{f"trajectories_{k}": v for k, v in self.intake.counts.items()},
        )

    async def _step(self, groups: list[list[Pending[Msg]]], stop: asyncio.Event) -> None:
        pendings = [p for g in groups for p in g]
        self.intake.stepping = pendings
        try:
            await self._step_groups(groups, pendings, stop)
        finally:
            self.intake.stepping = []

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
            samples = [s for p in pendings for s in to_samples(p.traj)]
            try:
                group = self.hybrid.group if self.hybrid.members else None
                stats = await self.intake.while_stepping(
                    asyncio.to_thread(self.learner.step, samples, stop.is_set, group),
                    self.run.training.groups_per_step,
                )
                self.hybrid.stepped(self.learner.group_error)
                path = await asyncio.to_thread(self.learner.commit, ids, self.lead.token)
            except StepAborted:
                self.log.info("train_step_abandoned", trajectories=len(pendings))
                await self.intake.hand_back(pendings)
                return
            except BaseException:
                await self.intake.hand_back(pendings)
                raise
            if not await self.lead.record_commit(ids, str(path), stop):
                await self.intake.hand_back(pendings)
                await self.lead.roll_back()
                return
            filtered, sampled = await self.intake.trained(groups)
            every = self.run.training.save_every
            if every and self.learner.state.step % every == 0 and self.run.training.backend != "emulated":
                saved = await asyncio.to_thread(self.learner.save_policy, self.common.run_id)
                self.log.info("policy_saved", step=self.learner.state.step, path=str(saved))
            span.set_attribute("libra.weight_version", self.version)
            span.set_attribute("libra.data_parallel", stats.data_parallel)
            trace_into_trajectories(span, pendings, self.learner.state.step, self.version)
            log_step(self.log, self.learner.state.step, self.version, stats, filtered)
            # the push streams in the background while the next step trains
            await self.weights.snapshot()
            if not stop.is_set():
                self.weights.request(trace.set_span_in_context(span))
        await self._publish_step(stats, 0.0, 0, filtered, sampled)

    async def _publish_step(
        self, stats: StepStats, push_s: float, push_bytes: int, filtered: int, sampled: list[float]
    ) -> None:
        done = self.finished and self.weights.all_synced()
        self.last_metrics = step_metrics(
            stats,
            step=self.learner.state.step,
            version=self.version,
            push=(push_s, push_bytes),
            done=done,
            groups_ready=await self.intake.groups_ready(),
            filtered=filtered,
            sampled=sampled,
            lender=self.lender,
            lent_turns_answered=self.own_engine.turns_answered if self.own_engine else 0,
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

    async def _resync(self) -> None:
        """Asks the engines their versions in the background, so that those lacking the current
        weights get them; if finished and every engine has them, announces done. Only the trainer
        holding the role does: a standby's weights are not the job's."""
        if not self.lead.leading:
            return
        now = time.monotonic()
        if now - self._last_resync < self.settings.resync_interval_s:
            return
        self._last_resync = now
        if not self.finished or self.done_published:
            self.weights.refresh_soon()
            return
        await self.weights.refresh()  # the job's end waits for what the engines say they hold
        if self.weights.all_synced():
            final = ev.TrainMetrics()
            if self.last_metrics is not None:
                final.CopyFrom(self.last_metrics)
            final.step, final.weight_version, final.done = self.learner.state.step, self.version, True
            await self.bus.publish(subjects.TRAIN_METRICS, final)
            self._announce_done()

    def _announce_done(self) -> None:
        self.done_published = True
        self.log.info(
            "training_done", step=self.learner.state.step, policy_version=self.version, **self.intake.counts
        )


async def serve(
    common: CommonSettings, run: RunConfig, stop: asyncio.Event, stack: contextlib.AsyncExitStack
) -> None:
    settings = load_settings(TrainerSettings)
    log = get_logger(component="trainer")
    worker_id = common.worker_id or "trainer"

    from services.learning.checkpoint import checkpoint_dir
    from services.learning.learner import Learner

    ckpt_dir = checkpoint_dir(run.training.checkpoint_dir, common.run_id)
    learner = await asyncio.to_thread(Learner, LearnJob.of(run), ckpt_dir)
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
                optimizer_state=str(learner.optimizer_from or "fresh"),
            )

    store = common.ownership_store()
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
        signer=common.weight_signer(),
    )
    stack.push_async_callback(pusher.close)
    bus = await Bus.connect(
        common.nats_url, common.run_id, "trainer", worker_id, common.nats_auth(), common.nats_tls()
    )
    stack.push_async_callback(bus.close)
    membership = Membership(bus, store, ev.WorkerHello(worker_id=worker_id, kind="trainer"))
    await membership.start()

    own_engine = None
    if run.planner.lending.trainer_serves:
        own_engine = TrainerEngine(
            common,
            EngineJob.of(run),
            (run.lending_bucket, run.planner.lending.tensor_parallel),
            learner,
            store,
            worker_id,
        )
        stack.push_async_callback(own_engine.shutdown)
        await own_engine.start()
    service = TrainerService(common, settings, run, learner, bus, store, membership, pusher, own_engine)
    await service.open_consumer()
    log.info("trainer_ready", step=learner.state.step, policy_version=learner.state.version)
    await service.run_until(stop)
