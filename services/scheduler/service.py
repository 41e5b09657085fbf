"""The scheduler's service shell: feeds tasks, drives each trajectory's state machine over the bus,
routes turns to engines and publishes completed trajectories durably for the trainer."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.config import CommonSettings
from services.common.contracts import ev
from services.common.errors import FencedOut, UserCodeBroken
from services.common.facts import FactsOut
from services.common.logging import get_logger
from services.common.membership import SERVING_ROLES, Membership
from services.common.metrics import scheduler_metrics
from services.common.ownership import OwnershipStore
from services.common.runconfig import RunConfig
from services.common.tasks import Phases
from services.policy.dispatch import build_dispatcher
from services.scheduler.agent import STOP_STRINGS
from services.scheduler.completion import Completion
from services.scheduler.config import SchedulerSettings
from services.scheduler.driver import TrajectoryDriver
from services.scheduler.episode_kinds import build_episode
from services.scheduler.evaluation import Evaluator
from services.scheduler.feed import build_feed
from services.scheduler.groups import Groups
from services.scheduler.inflight import InFlight, Live
from services.scheduler.leadership import Leadership
from services.scheduler.ledger import Ledger, durably, ledger_facts
from services.scheduler.prompting import Prompter
from services.scheduler.rewards import SandboxClient, Scorer, reward_ref
from services.scheduler.roster import Roster
from services.scheduler.routing_memory import RoutingMemory
from services.scheduler.tool_calls import ToolCalls
from services.scheduler.versions import TrainedVersion
from services.scheduler.workload import WorkloadWindow


class SchedulerService:
    """The shell: subscribes, ticks the feed (groups out under the staleness bound, outcomes in,
    evaluation rounds, a resumed run's ledger) and answers for the scheduler; each trajectory's
    turns are the driver's (`driver.py`), what is in flight the transport's (`inflight.py`)."""

    def __init__(
        self,
        common: CommonSettings,
        settings: SchedulerSettings,
        cfg: RunConfig,
        bus: Bus,
        store: OwnershipStore,
        prompter: Prompter,
        vocab_size: int | None = None,
    ):
        """`vocab_size`: the model's; turn results with other token ids are refused."""
        self.common, self.settings, self.cfg = common, settings, cfg
        self.bus, self.store, self.prompter = bus, store, prompter
        self._cpu_mark = (time.monotonic(), time.process_time())
        self.log = get_logger(component="scheduler")
        self.membership = Membership(
            bus,
            store,
            ev.WorkerHello(worker_id=bus.worker_id, kind="scheduler"),
            on_plan=self._on_plan,
        )
        self.leadership = Leadership(self.membership, store, self.log)
        """Whether this scheduler acts for the job or stands by (`stand_by`)."""
        self.feed = build_feed(cfg.task, cfg.training)
        self.dispatch = build_dispatcher(cfg.rollout.buckets, cfg.rollout.policy, cfg.rollout.max_batch)
        self.versions = TrainedVersion(bus, self.log)
        self.metrics = scheduler_metrics()
        task = cfg.task
        stop_strings = STOP_STRINGS if task.stop_strings is None else task.stop_strings
        ref = reward_ref(task)
        calls = ToolCalls()
        sandbox = SandboxClient(bus, calls)
        scorer = Scorer(task, ref, sandbox) if ref else None
        self.started = time.monotonic()
        self.workload = WorkloadWindow(settings.stats_window_s)
        self._stats_published = 0.0
        self._first: Phases | None = None
        self.ledger = Ledger(store.r, common.run_id, guard=self.leadership.require)
        self.routing_memory = RoutingMemory(
            self.dispatch.router, self.ledger, settings.policy_save_s, self.log
        )
        self.facts = FactsOut(bus, subjects.FACTS_SCHEDULER)
        """The ledger's accounting and evaluation rounds, for the job's report."""
        self._facts_read = float("-inf")
        self.evaluator = Evaluator(cfg.eval, cfg.task, cfg.training.steps) if cfg.eval.every > 0 else None
        """Held-out evaluation rounds (`eval`), when configured."""
        self.broken = asyncio.Event()
        """Set when the job's own code fails on every call (`Completion.broken` says why)."""
        self.episode = build_episode(
            cfg.task,
            cfg.model.source,
            cfg.rollout.emulated.time_scale,
            prompter,
            bus.spawn,
            (settings.agent_host, settings.agent_port),
            common.tls(),
            bus,
        )
        self.completion = Completion(
            bus,
            self.ledger,
            self.workload,
            self.metrics,
            scorer,
            self.evaluator,
            lambda: self.trained_version,
            cfg.task,
        )
        self.started = False
        self.inflight = InFlight(
            bus, self.dispatch, settings, cfg.rollout, task, stop_strings, fail=self._fail, calls=calls
        )
        self.roster = Roster(self.inflight, settings)
        self.driver = TrajectoryDriver(
            common.run_id,
            task,
            bus,
            prompter,
            self.dispatch,
            self.inflight,
            self.roster,
            self.episode,
            self.completion,
            sandbox,
            self.workload,
            self.metrics,
            vocab_size=vocab_size,
            newest_version=self.versions.newest,
            handovers=settings.handovers,
        )
        self.groups = Groups(
            task,
            cfg.training.max_staleness,
            bus,
            self.feed,
            self.ledger,
            self.episode,
            self.driver,
            self.completion,
            self.versions,
        )

    async def _fail(self, live: Live, code: str, message: str) -> None:
        await self.driver.fail(live, code, message)

    def _cpu_utilisation(self) -> float:
        """This process's CPU seconds over wall seconds since it took the job (1.0: one core)."""
        wall0, cpu0 = self._cpu_mark
        return (time.process_time() - cpu0) / max(1e-9, time.monotonic() - wall0)

    async def stand_by(self, stop: asyncio.Event) -> bool:
        """Joins the plan and waits, warm, until this scheduler holds the role (at once for the
        job's only scheduler; a standby when the holder's lease runs out). False: stopped first.
        While it waits it keeps what the acting scheduler's routing policy learned loaded
        (`routing_memory.py`)."""
        await self.membership.start()
        waiting = asyncio.Event()
        waiting.set()
        self.bus.spawn(self.routing_memory.keep_warm(waiting))
        try:
            return await self.leadership.wait_for_role(stop)
        finally:
            waiting.clear()  # its read under way ends on its own: a Redis call cancelled mid-way
            # can leave its connection with a reply unread

    async def start(self) -> None:
        """Takes the job up: from its ledger when an earlier scheduler of it left one."""
        self.started = True
        self._cpu_mark = (time.monotonic(), time.process_time())
        phases = Phases()  # where a takeover's time goes (the log's scheduler_started)
        phase = phases.mark
        await self.bus.bind_stream("TRAJ")  # where completed trajectories go
        await self.groups.bind()
        await self.bus.subscribe(subjects.TURN_RESULT, ev.TurnResult, self.driver.on_turn_result)
        await self.bus.subscribe(subjects.TURN_PROGRESS, ev.TurnProgress, self.driver.on_turn_progress)
        await self.bus.subscribe(subjects.TOOL_RETURN, ev.ToolReturn, self.driver.on_tool_return)
        await self.bus.subscribe(subjects.ENGINE_LOAD, ev.EngineLoad, self._on_engine_load)
        await self.bus.subscribe(subjects.WEIGHTS_UPDATED, ev.WeightsUpdated, self.versions.on_weights)
        await self.bus.subscribe(subjects.SCHEDULER_STATS, ev.StatsRequest, self._on_stats)
        phase("subscribe")
        if self.completion.scorer is not None:
            await self.completion.scorer.start()  # a reward that cannot be imported stops the scheduler now
        await self.episode.start()  # so does an environment
        await self.facts.start()
        phase("plugins")
        await self.groups.resume(self.evaluator, self.prompter)
        phase("resume")
        await self.routing_memory.take_up(self.bus.spawn)
        self.bus.spawn(self._loop())
        phase("routing")
        self.log.info("scheduler_started", phases_s=phases.seconds)

    async def _on_plan(self, plan: ev.Plan) -> None:
        limits = {b.name: float(b.max_output_tokens or math.inf) for b in plan.buckets}
        if limits and self.dispatch.router.set_thresholds(limits):
            self.log.info("bucket_thresholds_changed", thresholds=limits, reason=plan.reason)
        serving = {a.worker_id: a for a in plan.assignments if a.role in SERVING_ROLES}
        # out of rollout under the same lease: the engine hands its turns back itself
        moved = {a.worker_id: a.fencing_token for a in plan.assignments if a.role not in SERVING_ROLES}
        await self.roster.set_engines(serving, moved)

    async def _on_engine_load(self, load: ev.EngineLoad, _: Envelope) -> None:
        await self.roster.engine_load(load)

    @property
    def trained_version(self) -> int:
        return self.versions.version

    async def _on_stats(self, _: ev.StatsRequest, __: Envelope) -> ev.SchedulerStats:
        done, inflight = self.completion, self.inflight
        return ev.SchedulerStats(
            trajectories_completed=done.completed,
            trajectories_in_flight=len(inflight),
            tool_calls_by_status=dict(self.driver.tool_statuses),
            turns=self.driver.turns,
            reward_mean=sum(done.rewards) / len(done.rewards) if done.rewards else 0.0,
            groups_launched=self.feed.launched,
            groups_total=self.feed.total_groups,
            trained_version=self.trained_version,
            engines=sorted(self.dispatch.engines),
            groups_replaced=self.feed.replaced,
            group_outcomes=dict(self.feed.outcomes),
            trajectories_failed=done.failed,
            failures_by_code=dict(done.failure_codes),
            migrations=self.dispatch.migrations,
            turns_handed_back=self.driver.handed_back,
            invalid_results_by_engine=dict(self.roster.quarantine.invalid),
            engines_quarantined=sorted(self.roster.quarantine.out),
            tokens_kept_on_hand_back=self.driver.results.tokens_kept,
            context_tokens_sent=inflight.context_tokens["sent"],
            context_tokens_held=inflight.context_tokens["held"],
            turn_request_bytes=self.bus.bytes_out[subjects.TURN_REQUEST],
            turn_result_bytes=self.bus.bytes_in[subjects.TURN_RESULT],
            decisions=self.dispatch.decisions,
            decision_p50_us=inflight.times.decision_quantile(0.5),
            decision_p99_us=inflight.times.decision_quantile(0.99),
            decision_cpu_p50_us=inflight.times.decision_cpu_quantile(0.5),
            decision_cpu_p99_us=inflight.times.decision_cpu_quantile(0.99),
            dispatch_p50_us=inflight.times.dispatch_quantile(0.5),
            dispatch_p99_us=inflight.times.dispatch_quantile(0.99),
            cpu_utilisation=self._cpu_utilisation(),
            agent_calls_refused=self.episode.calls_refused(),
            agent_history_rewrites=self.episode.history_rewrites(),
            agent_alternatives_kept=self.episode.alternatives_kept(),
            messages_received=self.bus.received,
            messages_published=self.bus.published,
            oldest_in_flight=inflight.oldest(20, time.monotonic()),
        )

    async def close(self) -> None:
        if not self.started:  # a standby: nothing was started
            return
        if self.completion.scorer is not None:
            await self.completion.scorer.close()
        await self.episode.close()

    async def _loop(self) -> None:
        waited_since = time.monotonic()
        started = False
        self._first = Phases()  # the first tick's time, phase by phase (the log's first_tick)
        while True:
            await asyncio.sleep(self.settings.tick_s)
            if not await self.leadership.still_leading():
                continue  # unsure whether the role is still this scheduler's, or fenced out
            # at the start it waits (up to engine_wait_s) for the configured engines; once it has
            # begun, an engine that leaves (drained, dead) slows the run but never pauses it
            enough = started or len(self.dispatch.engines) >= self.cfg.rollout.engines
            if not self.dispatch.engines or (
                not enough and time.monotonic() - waited_since < self.settings.engine_wait_s
            ):
                continue
            started = True
            self._phase("waited")
            try:
                await self._tick()
            except Exception:  # one bad tick (NATS away mid-publish) must not end the loop
                self.log.exception("scheduler_tick_failed")
            if self._first is not None:
                self.log.info("first_tick", phases_s=self._first.seconds)
                self._first = None

    def _phase(self, name: str) -> None:
        if self._first is not None:
            self._first.mark(name)

    async def _tick(self) -> None:
        """Outcomes in, new groups out, lost turns and tools re-sent, workload stats published."""
        if self.completion.broken is not None and not self.broken.is_set():
            self.log.error("user_code_broken", reason=self.completion.broken)
            self.broken.set()  # `serve` ends the job failed with the reason
            return
        await self.groups.consume_outcomes()
        await self.versions.tick()
        await self.groups.abort_hopeless(self.inflight)
        self._phase("outcomes")
        tickets = self.feed.take(self.trained_version)
        if tickets:
            await durably(self.ledger.launched(self.feed, tickets), self.log)
        for ticket in tickets:
            self.groups.launch(ticket)
        if self.evaluator is not None and (version := self.evaluator.due(self.trained_version)) is not None:
            self.groups.launch_eval(self.evaluator, self.prompter, version)
        self._phase("launch")
        await self.inflight.drain_all()
        self._phase("dispatch")
        await self.inflight.watchdog(time.monotonic())
        if time.monotonic() - self._stats_published > self.settings.stats_interval_s:
            await self._publish_workload()
        self._update_gauges()
        if self.ledger.changed and time.monotonic() - self._facts_read > 0.5:
            self._facts_read = time.monotonic()
            self.facts.update(await ledger_facts(self.ledger))
        await self.routing_memory.save_if_due()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.in_flight.set(len(self.inflight))
        m.trained_version.set(self.trained_version)
        queued, running = self.dispatch.queued_by_bucket(), self.dispatch.running_by_bucket()
        for b in self.cfg.rollout.buckets:
            m.queued.labels(b.name).set(queued.get(b.name, 0))
            m.running.labels(b.name).set(running.get(b.name, 0))

    async def _publish_workload(self) -> None:
        self._stats_published = time.monotonic()
        stats = self.workload.stats(
            self._stats_published, self.dispatch.queued_by_bucket(), self.trained_version
        )
        stats.running_turns_by_bucket.update(self.dispatch.running_by_bucket())
        with contextlib.suppress(Exception):  # NATS away: the next one goes out in a few seconds
            await self.bus.publish(subjects.WORKLOAD_STATS, stats)


async def serve(
    common: CommonSettings, run: RunConfig, stop: asyncio.Event, stack: contextlib.AsyncExitStack
) -> None:
    from services.common.config import load_settings
    from services.common.models import load_tokenizer

    settings = load_settings(SchedulerSettings)
    cfg = run
    assert common.worker_id is not None
    # off the event loop: loading the tokenizer took 30-36 s on a CPU busy with 1,024 engines
    # starting, and the job's heartbeats (this loop) must go on meanwhile, or it looks hung
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model)
    prompter = Prompter(tokenizer, cfg.task.dataset, cfg.task.worked_examples)
    bus = await Bus.connect(
        common.nats_url, common.run_id, "scheduler", common.worker_id, common.nats_auth(), common.nats_tls()
    )
    stack.push_async_callback(bus.close)
    store = common.ownership_store()
    stack.push_async_callback(store.close)
    svc = SchedulerService(common, settings, cfg, bus, store, prompter, model_vocabulary(cfg))
    stack.push_async_callback(svc.close)
    if not await svc.stand_by(stop):
        return  # the job ended while this scheduler stood by
    await svc.start()
    get_logger().info("scheduler_ready", prompts=cfg.task.num_prompts, group_size=cfg.task.group_size)
    waits = [asyncio.ensure_future(e.wait()) for e in (stop, svc.broken, svc.leadership.fenced)]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for w in waits:
        w.cancel()
    if svc.leadership.fenced.is_set() and not stop.is_set():
        raise FencedOut("another scheduler holds the role: this one stands by")
    if svc.broken.is_set() and not stop.is_set():
        raise UserCodeBroken(svc.completion.broken or "the job's own code fails on every call")


def model_vocabulary(cfg: RunConfig) -> int:
    """The token ids an engine of this job can sample: the model's vocabulary (its config's, which
    may pad the tokenizer's), or the emulated engines' (`services/generation/backends/emulated.py`)."""
    from services.common.models import vocabulary_size

    vocab = vocabulary_size(cfg.model)
    if cfg.rollout.backend == "emulated":
        from services.generation.backends.emulated import VOCAB_SIZE

        vocab = max(vocab, VOCAB_SIZE)
    return vocab
