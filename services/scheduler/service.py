"""The scheduler's service shell: feeds tasks, drives each trajectory's state machine over the bus,
routes turns to engines and publishes completed trajectories durably for the trainer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry import trace

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.config import CommonSettings
from services.common.contracts import ev
from services.common.errors import require
from services.common.logging import get_logger
from services.common.membership import SERVING_ROLES, Membership
from services.common.metrics import scheduler_metrics
from services.common.ownership import OwnershipStore
from services.common.runconfig import RunConfig
from services.common.tracing import tracer
from services.scheduler.agent import STOP_STRINGS, observation
from services.scheduler.config import SchedulerSettings
from services.scheduler.dispatch import build_dispatcher
from services.scheduler.environment import EnvPool, Step
from services.scheduler.evaluation import Evaluator
from services.scheduler.feed import GroupTicket, build_feed
from services.scheduler.ledger import Ledger
from services.scheduler.plugins import PluginFailure
from services.scheduler.prefix_tree import ToolSignal, map_sandbox_status, size_class
from services.scheduler.prompting import Prompter
from services.scheduler.rewards import SandboxClient, Scorer, reward_ref
from services.scheduler.synthetic_task import SyntheticTask
from services.scheduler.task import Task
from services.scheduler.trajectory import (
    Action,
    CallTool,
    Finish,
    Generate,
    Reply,
    Trajectory,
    check_turn,
    doomed_groups,
)
from services.scheduler.workload import WorkloadWindow

T = TypeVar("T")
KNOWN_TOOL_STATUSES = ("ok", "error", "timeout", "killed", "rejected")
"""Tool statuses with their own metric label (anything else a sandbox sends counts as `other`)."""


@dataclass
class Live:
    """A trajectory in flight, with the span that is its trace."""

    traj: Trajectory
    span: trace.Span
    bucket: str
    step_span: trace.Span | None = None
    request_id: str = ""
    call_id: str = ""
    engine_id: str = ""
    deadline: float = 0.0
    sent_at: float = 0.0
    missing: int = 0
    retries: int = 0
    pending_action: Generate | None = None
    pending_tool: CallTool | None = None
    tool_attempts: int = 0
    failure: ev.ErrorInfo | None = None
    last_error: str = ""
    history: list[str] = field(default_factory=list)
    queued_at: float | None = None
    """When its pending turn entered a bucket queue (None: not queued)."""
    queue_span: trace.Span | None = None
    times: ev.LatencyBreakdown = field(default_factory=ev.LatencyBreakdown)
    """Where its time went so far (CompletedTrajectory.breakdown)."""
    tool_log: list[dict[str, Any]] = field(default_factory=list)
    """Its tool calls (tool, args, status, observation), for a `task.reward` function."""
    scoring: bool = False
    """Finished, waiting for its `task.reward` score."""
    replies: list[str] = field(default_factory=list)
    """What its environment said between turns (a `task.environment`'s observations)."""
    evaluation: bool = False
    """A held-out evaluation trajectory: scored, never sent to the trainer."""


class SchedulerService:
    def __init__(
        self,
        common: CommonSettings,
        settings: SchedulerSettings,
        cfg: RunConfig,
        bus: Bus,
        store: OwnershipStore,
        prompter: Prompter,
    ):
        self.common, self.settings, self.cfg = common, settings, cfg
        self.bus, self.store, self.prompter = bus, store, prompter
        self.log = get_logger(component="scheduler")
        self.feed = build_feed(cfg)
        self.synthetic = SyntheticTask(cfg) if cfg.task.dataset == "synthetic" else None
        self.dispatch = build_dispatcher(cfg.rollout.buckets, cfg.rollout.policy, cfg.rollout.max_batch)
        self.bucket_level = {b.name: i for i, b in enumerate(cfg.rollout.buckets)}
        self._policy_saved = time.monotonic()
        self.aborted_groups = 0
        """Groups ended early because the trainer could no longer take them (`_abort_hopeless`)."""
        self.decision_us: deque[float] = deque(maxlen=20_000)
        """Latency of the most recent routing decisions (the policy's own work, in microseconds)."""
        self.engine_tokens: dict[str, int] = {}
        self._committed_checked = float("-inf")
        self.live: dict[str, Live] = {}
        self.by_request: dict[str, str] = {}
        self.by_call: dict[str, str] = {}
        self.trained_version = 0
        self.completed = 0
        self.failed = 0
        self.turns = 0
        self.rewards: list[float] = []
        self.tool_statuses: Counter[str] = Counter()
        self.failure_codes: Counter[str] = Counter()
        self.metrics = scheduler_metrics()
        for status in (*KNOWN_TOOL_STATUSES, "other"):  # every series exists from the start, at 0
            self.metrics.tool_calls.labels(status)
        ref = reward_ref(cfg.task)
        self.sandbox = SandboxClient(bus)
        self.scorer = Scorer(cfg.task, ref, self.sandbox) if ref else None
        task = cfg.task
        self.stop_strings = STOP_STRINGS if task.stop_strings is None else task.stop_strings
        self.envs = (
            EnvPool(task.environment, task.plugin_paths, task.env_workers, task.env_timeout_s)
            if task.environment
            else None
        )
        self.started = time.monotonic()
        self.workload = WorkloadWindow(settings.stats_window_s)
        self._stats_published = 0.0
        self.ledger = Ledger(store.r, common.run_id)
        self.evaluator = Evaluator(cfg) if cfg.eval.every > 0 else None
        """Held-out evaluation rounds (`eval`), when configured."""
        self._eval_nonce = uuid.uuid4().hex[:6]
        self.membership = Membership(
            bus,
            store,
            ev.WorkerHello(worker_id=bus.worker_id, kind="scheduler"),
            on_plan=self._on_plan,
        )

    async def start(self) -> None:
        self.traj_stream = await self.bus.ensure_stream("TRAJ", [subjects.TRAJ_COMPLETED])
        groups = await self.bus.ensure_stream("GROUPS", [subjects.GROUP_OUTCOME])
        self.outcomes = await self.bus.pull_consumer(
            subjects.GROUP_OUTCOME, durable="scheduler-feed", stream=groups, ack_wait_s=60
        )
        await self.bus.subscribe(subjects.TURN_RESULT, ev.TurnResult, self._on_turn_result)
        await self.bus.subscribe(subjects.TOOL_RETURN, ev.ToolReturn, self._on_tool_return)
        await self.bus.subscribe(subjects.ENGINE_LOAD, ev.EngineLoad, self._on_engine_load)
        await self.bus.subscribe(subjects.WEIGHTS_UPDATED, ev.WeightsUpdated, self._on_weights)
        await self.bus.subscribe(subjects.SCHEDULER_STATS, ev.StatsRequest, self._on_stats)
        if self.scorer is not None:
            await self.scorer.start()  # a reward that cannot be imported stops the scheduler now
        if self.envs is not None:
            await self.envs.start()  # so does an environment
        await self._resume()
        await self._load_policy()
        await self.membership.start()
        self.bus.spawn(self._loop())

    async def _on_plan(self, plan: ev.Plan) -> None:
        limits = {b.name: float(b.max_output_tokens or math.inf) for b in plan.buckets}
        if limits and self.dispatch.router.set_thresholds(limits):
            self.log.info("bucket_thresholds_changed", thresholds=limits, reason=plan.reason)
        current = {a.worker_id: a for a in plan.assignments if a.role in SERVING_ROLES}
        # an engine that left the plan, or came back under a new lease (it restarted), has lost
        # whatever turns it was running
        gone = [
            wid
            for wid in self.dispatch.engines
            if wid not in current or current[wid].fencing_token != self.engine_tokens.get(wid)
        ]
        self.dispatch.forget(gone)  # a restarted engine comes back with no turns in flight
        self.dispatch.set_engines({wid: a.bucket for wid, a in current.items()})
        self.engine_tokens = {wid: a.fencing_token for wid, a in current.items()}
        self.log.info(
            "engines_updated",
            engines={wid: e.bucket for wid, e in sorted(self.dispatch.engines.items())},
        )
        for live in list(self.live.values()):  # turns on an engine that left are re-sent at once
            if live.engine_id in gone and live.request_id in self.by_request and live.pending_action:
                self.by_request.pop(live.request_id, None)
                self.log.info(
                    "turn_redispatched", trajectory_id=live.traj.trajectory_id, engine_id=live.engine_id
                )
                await self._send_turn(live, live.pending_action)
        await self._drain_all()

    async def _on_engine_load(self, load: ev.EngineLoad, _: Envelope) -> None:
        if load.engine_id not in self.dispatch.engines:
            return
        self.dispatch.set_capacity(load.engine_id, load.capacity_seqs)
        # a turn the engine does not hold, two reports in a row, was lost on the way there or back
        # (a NATS restart, a dropped message): re-sent now rather than after the turn timeout
        held = set(load.request_ids)
        now = time.monotonic()
        for live in list(self.live.values()):
            if live.engine_id != load.engine_id or live.request_id not in self.by_request:
                continue
            if live.request_id in held or now - live.sent_at < self.settings.lost_turn_grace_s:
                live.missing = 0
                continue
            live.missing += 1
            if live.missing >= 2 and live.pending_action is not None:
                self._forget_turn(live)
                self.log.warning("turn_lost", trajectory_id=live.traj.trajectory_id, engine_id=load.engine_id)
                live.missing = 0
                await self._send_turn(live, live.pending_action)

    async def _on_weights(self, msg: ev.WeightsUpdated, _: Envelope) -> None:
        if msg.version > self.trained_version:
            self.trained_version = msg.version
            self.log.info("policy_version", version=msg.version)

    async def _on_stats(self, _: ev.StatsRequest, __: Envelope) -> ev.SchedulerStats:
        now = time.monotonic()
        oldest = sorted(self.live.values(), key=lambda lv: lv.traj.started_at)[:20]
        return ev.SchedulerStats(
            trajectories_completed=self.completed,
            trajectories_in_flight=len(self.live),
            tool_calls_by_status=dict(self.tool_statuses),
            turns=self.turns,
            reward_mean=sum(self.rewards) / len(self.rewards) if self.rewards else 0.0,
            groups_launched=self.feed.launched,
            groups_total=self.feed.total_groups,
            trained_version=self.trained_version,
            engines=sorted(self.dispatch.engines),
            groups_replaced=self.feed.replaced,
            group_outcomes=dict(self.feed.outcomes),
            trajectories_failed=self.failed,
            failures_by_code=dict(self.failure_codes),
            migrations=self.dispatch.migrations,
            decisions=self.dispatch.decisions,
            decision_p50_us=self._decision_quantile(0.5),
            decision_p99_us=self._decision_quantile(0.99),
            messages_received=self.bus.received,
            messages_published=self.bus.published,
            oldest_in_flight=[
                ev.InFlight(
                    trajectory_id=lv.traj.trajectory_id,
                    group_id=lv.traj.group_id,
                    state=self._state_of(lv),
                    engine_id=lv.engine_id if lv.request_id in self.by_request else "",
                    turns=lv.traj.turns,
                    age_s=now - lv.traj.started_at,
                    idle_s=now - lv.sent_at if lv.sent_at else 0.0,
                )
                for lv in oldest
            ],
        )

    async def close(self) -> None:
        if self.scorer is not None:
            await self.scorer.close()
        if self.envs is not None:
            await self.envs.close()

    def _state_of(self, live: Live) -> str:
        if live.scoring:
            return "scoring"
        if live.call_id and live.call_id in self.by_call:
            return "tool"
        if live.request_id and live.request_id in self.by_request:
            return "generating"
        if live.traj.trajectory_id in self.dispatch.queued:
            return "queued"
        return "waiting_for_engine"

    async def _loop(self) -> None:
        waited_since = time.monotonic()
        started = False
        while True:
            await asyncio.sleep(self.settings.tick_s)
            # at the start it waits (up to engine_wait_s) for the configured engines; once it has
            # begun, an engine that leaves (drained, dead) slows the run but never pauses it
            enough = started or len(self.dispatch.engines) >= self.cfg.rollout.engines
            if not self.dispatch.engines or (
                not enough and time.monotonic() - waited_since < self.settings.engine_wait_s
            ):
                continue
            started = True
            try:
                await self._tick()
            except Exception:  # one bad tick (NATS away mid-publish) must not end the loop
                self.log.exception("scheduler_tick_failed")

    async def _tick(self) -> None:
        """Outcomes in, new groups out, lost turns and tools re-sent, workload stats published."""
        await self._consume_outcomes()
        if time.monotonic() - self._committed_checked > 2.0:
            await self._check_committed()
        await self._abort_hopeless()
        tickets = self.feed.take(self.trained_version)
        if tickets:
            await self._durably(self.ledger.launched(self.feed, tickets))
        for ticket in tickets:
            self._launch_group(ticket)
        if self.evaluator is not None and (version := self.evaluator.due(self.trained_version)) is not None:
            self._launch_eval(version)
        await self._drain_all()
        await self._watchdog()
        if time.monotonic() - self._stats_published > self.settings.stats_interval_s:
            await self._publish_workload()
        self._update_gauges()
        if time.monotonic() - self._policy_saved > self.settings.policy_save_s:
            self._policy_saved = time.monotonic()
            await self._durably(self.ledger.save_policy(self.dispatch.router.to_dict()))

    def _update_gauges(self) -> None:
        m = self.metrics
        m.in_flight.set(len(self.live))
        m.trained_version.set(self.trained_version)
        queued, running = self.dispatch.queued_by_bucket(), self.dispatch.running_by_bucket()
        for b in self.cfg.rollout.buckets:
            m.queued.labels(b.name).set(queued.get(b.name, 0))
            m.running.labels(b.name).set(running.get(b.name, 0))

    async def _abort_hopeless(self) -> None:
        """Ends the in-flight trajectories of groups the trainer can no longer take: a member's
        first tokens are older than the staleness bound allows at the trained version (the bound
        only tightens), so the whole group would be dropped when it completes. They end as failed
        (`stale`, never trained), their engine slots free at once, and the feed replaces the group,
        instead of the group running to the end for nothing (the simulator aborts them the same way)."""
        trajs = [lv.traj for lv in self.live.values() if not lv.evaluation]
        doomed = doomed_groups(trajs, self.trained_version, self.cfg.training.max_staleness)
        if not doomed:
            return
        for live in [lv for lv in self.live.values() if lv.traj.group_id in doomed and not lv.evaluation]:
            self._forget_turn(live)
            self.by_call.pop(live.call_id, None)
            if live.step_span is not None:
                live.step_span.end()
            await self._fail(
                live,
                "stale",
                f"group {live.traj.group_id} can no longer be trained at version {self.trained_version} "
                f"(max_staleness {self.cfg.training.max_staleness})",
            )
        self.aborted_groups += len(doomed)

    async def _load_policy(self) -> None:
        """What an earlier scheduler of this job learned (C-MLFQ's prefix trees), if it saved any."""
        try:
            state = await self.ledger.load_policy()
        except Exception as err:
            self.log.warning("policy_state_unavailable", error=str(err))
            return
        if state:
            self.dispatch.router.load_dict(state)
            self.log.info("policy_state_restored")

    async def _publish_workload(self) -> None:
        self._stats_published = time.monotonic()
        stats = self.workload.stats(
            self._stats_published, self.dispatch.queued_by_bucket(), self.trained_version
        )
        stats.running_turns_by_bucket.update(self.dispatch.running_by_bucket())
        with contextlib.suppress(Exception):  # NATS away: the next one goes out in a few seconds
            await self.bus.publish(subjects.WORKLOAD_STATS, stats)

    async def _check_committed(self) -> None:
        """The trainer's commit record is the floor of the trained version: a `weights.updated`
        missed while this scheduler was down (core NATS keeps none) costs a few seconds, not the job."""
        self._committed_checked = time.monotonic()
        try:
            version = int((await self.store.committed()).get("version", 0))
        except Exception as err:
            self.log.warning("commit_record_unavailable", error=str(err))
            return
        if version > self.trained_version:
            self.trained_version = version
            self.log.info("policy_version", version=version, source="commit_record")

    async def _durably(self, write: Any) -> None:
        """A ledger write; if Redis is away the run goes on, only a restart could not resume it."""
        try:
            await write
        except Exception as err:
            self.log.warning("ledger_write_failed", error=f"{type(err).__name__}: {err}")

    async def _resume(self) -> None:
        """Continues an earlier scheduler's run of this job from the ledger, if there was one."""
        if self.evaluator is not None:
            self.evaluator.done.update(await self.ledger.load_eval())
        state = await self.ledger.load()
        if state is None:
            return
        outstanding = self.feed.restore(
            launched=state.launched,
            replaced=state.replaced,
            total_groups=state.total_groups,
            outstanding=list(state.outstanding.values()),
            outcomes=state.outcomes,
        )
        self.completed, self.failed = state.completed, state.failed
        self.trained_version = int((await self.store.committed()).get("version", 0))
        reissued = 0
        for ticket in outstanding:
            reissued += self._launch_group(ticket, skip=state.published)
        self.log.info(
            "scheduler_resumed",
            groups_launched=state.launched,
            groups_outstanding=len(outstanding),
            trajectories_reissued=reissued,
            trained_version=self.trained_version,
        )

    async def _consume_outcomes(self) -> None:
        try:
            fetched = await self.bus.fetch(self.outcomes, ev.GroupOutcome, 64, 0.01)
        except Exception as err:  # NATS reconnecting: the outcomes stay on the stream
            self.log.warning("outcome_fetch_failed", error=str(err))
            return
        for out, raw in fetched:
            if out.group_id in self.feed.outstanding:
                replaced = self.feed.resolve(out.group_id, out.outcome)
                await self._durably(self.ledger.resolved(self.feed, out.group_id, out.outcome))
                if replaced:
                    self.log.info(
                        "group_replaced", group_id=out.group_id, outcome=out.outcome, reason=out.reason
                    )
            with contextlib.suppress(Exception):
                await raw.ack()

    def _launch_group(self, ticket: GroupTicket, skip: Collection[str] = ()) -> int:
        """Starts the group's trajectories (but those in `skip`, already with the trainer)."""
        size = self.cfg.task.group_size
        specs = self.synthetic.group(ticket, self.trained_version) if self.synthetic else []
        prompt_ids = [] if self.synthetic else self.prompter.prompt_ids(ticket.task)
        launched = 0
        for i in range(size):
            if ticket.trajectory_id(i) in skip:
                continue
            launched += 1
            script = None
            if self.synthetic is not None:
                script = self.synthetic.script(specs[i])
                prompt_ids = self.synthetic.prompt_ids(specs[i])
            self._start(
                ticket.trajectory_id(i),
                ticket.group_id,
                i,
                size,
                ticket.task,
                prompt_ids,
                script,
                self.trained_version,
            )
        return launched

    def _launch_eval(self, version: int) -> None:
        """An evaluation round of the policy at `version`: one trajectory per held-out prompt, each
        its own group of one, whose turns wait for engines that hold that version."""
        assert self.evaluator is not None
        rnd = self.evaluator.start(version, self._eval_nonce)
        for i, task in enumerate(self.evaluator.tasks):
            tid = rnd.trajectory_id(i)
            self._start(tid, tid, 0, 1, task, self.prompter.prompt_ids(task), None, version, evaluation=True)
        self.log.info("eval_started", policy_version=version, prompts=rnd.total)

    def _start(
        self,
        trajectory_id: str,
        group_id: str,
        index: int,
        size: int,
        task: Task,
        prompt_ids: list[int],
        script: Any,
        launch_version: int,
        evaluation: bool = False,
    ) -> None:
        traj = Trajectory(
            trajectory_id=trajectory_id,
            group_id=group_id,
            sample_index=index,
            group_size=size,
            task=task,
            prompt_ids=prompt_ids,
            max_turns=len(script) if script else self.cfg.task.max_turns,
            max_new_tokens=self.cfg.task.max_new_tokens,
            max_context_tokens=self.cfg.task.max_context_tokens,
            started_at=time.monotonic(),
            script=script,
            launch_version=launch_version,
            tool_bonus=self.cfg.task.tool_bonus,
            scored_outside=self.scorer is not None,
            builtin_reward=self.envs is None,
        )
        span = tracer().start_span(
            "evaluation" if evaluation else "trajectory",
            attributes={
                "libra.trajectory_id": traj.trajectory_id,
                "libra.group_id": traj.group_id,
                "libra.prompt_id": task.prompt_id,
                "libra.run_id": self.common.run_id,
            },
        )
        bucket = self.dispatch.admit(traj.trajectory_id, task.prompt_id, time.monotonic())
        live = self.live[traj.trajectory_id] = Live(traj, span, bucket, evaluation=evaluation)
        if not evaluation:
            self.workload.launched(traj.trajectory_id)
        self.bus.spawn(self._begin(live))

    async def _begin(self, live: Live) -> None:
        """A user environment's `reset` (it may bring its own prompt), then the first turn."""
        traj = live.traj
        if self.envs is not None:
            live.deadline = math.inf  # the environment's own timeout bounds it
            with tracer().start_as_current_span("env.reset", context=trace.set_span_in_context(live.span)):
                prompt = await self.envs.reset(traj.trajectory_id, traj.task.row())
            if self.live.get(traj.trajectory_id) is not live:
                return  # aborted meanwhile
            if isinstance(prompt, PluginFailure):
                await self._fail(live, prompt.code, f"reset: {prompt.message}")
                return
            if prompt is not None:
                traj.set_prompt(self.prompter.render(prompt))
        await self._execute(live, traj.first_action())

    async def _execute(self, live: Live, action: Action) -> None:
        if isinstance(action, Generate):
            await self._send_turn(live, action)
        elif isinstance(action, CallTool):
            await self._send_tool(live, action)
        elif isinstance(action, Reply):
            await self._reply(live, action)
        elif isinstance(action, Finish):
            if action.needs_score and self.scorer is not None and live.failure is None:
                live.scoring, live.deadline = True, math.inf  # the reward's own timeout bounds it
                self.bus.spawn(self._score(live, action))
            else:
                await self._finish(live, action)

    async def _score(self, live: Live, fin: Finish) -> None:
        """Scores a finished trajectory with `task.reward` off the event loop; a reward that fails
        fails the trajectory (typed), so it is never trained on as a negative sample."""
        assert self.scorer is not None
        traj = live.traj
        with tracer().start_as_current_span("reward", context=trace.set_span_in_context(live.span)) as span:
            result = await self.scorer.score(
                response=traj.texts[-1] if traj.texts else "",
                answer=traj.task.answer,
                sample=traj.task.row(),
                trajectory={
                    "turns": list(traj.texts),
                    "tool_calls": live.tool_log,
                    "observations": live.replies,
                    "finish": fin.reason,
                    "prompt_id": traj.task.prompt_id,
                },
            )
            if isinstance(result, PluginFailure):
                span.set_attribute("libra.reward_failure", result.code)
        if self.live.get(traj.trajectory_id) is not live:
            return  # aborted meanwhile (its group could no longer be trained)
        if isinstance(result, PluginFailure):
            await self._fail(live, result.code, result.message)
        else:
            await self._finish(live, Finish(fin.reason, result))

    async def _send_turn(self, live: Live, action: Generate) -> None:
        """Places the turn: on an engine with a free slot the policy picks, else in its bucket's
        queue until a slot frees (`_drain`)."""
        live.pending_action = action
        if not self.dispatch.engines:
            live.deadline = time.monotonic() + 1.0
            return
        engine_id = self._decide(self.dispatch.place, live.traj.trajectory_id, time.monotonic())
        if engine_id is None:
            live.deadline = math.inf  # queued: waits for a slot, however long the tail ahead of it
            if live.queued_at is None:
                live.queued_at = time.monotonic()
                live.queue_span = tracer().start_span(
                    "turn.queued",
                    context=trace.set_span_in_context(live.span),
                    attributes={"libra.turn": live.traj.turns, "libra.bucket": live.bucket},
                )
            return
        await self._dispatch(live, engine_id)

    async def _drain(self, engine_id: str) -> None:
        """Gives the engine's free slots to the turns the policy picks from the queues."""
        while (traj_id := self._decide(self.dispatch.next_for, engine_id, time.monotonic())) is not None:
            live = self.live.get(traj_id)
            if live is None or live.pending_action is None:
                self.dispatch.release(engine_id)
                continue
            await self._dispatch(live, engine_id)

    def _decide(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs one routing decision and records how long the policy took."""
        began = time.perf_counter()
        out = fn(*args)
        self.decision_us.append((time.perf_counter() - began) * 1e6)
        return out

    def _decision_quantile(self, q: float) -> float:
        if not self.decision_us:
            return 0.0
        ordered = sorted(self.decision_us)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    async def _drain_all(self) -> None:
        for engine_id in list(self.dispatch.engines):
            await self._drain(engine_id)

    def _forget_turn(self, live: Live) -> None:
        """The turn in flight is over (answered, lost or timed out): its engine slot frees."""
        if self.by_request.pop(live.request_id, None) is not None:
            self.dispatch.release(live.engine_id)

    async def _dispatch(self, live: Live, engine_id: str) -> None:
        traj, action = live.traj, live.pending_action
        assert action is not None
        self._dequeued(live)
        live.bucket = self.dispatch.where.get(traj.trajectory_id, live.bucket)
        live.request_id = uuid.uuid4().hex
        live.engine_id = engine_id
        live.sent_at = time.monotonic()
        live.deadline = time.monotonic() + self.settings.turn_timeout(action.max_new_tokens)
        self.by_request[live.request_id] = traj.trajectory_id
        ctx = trace.set_span_in_context(live.span)
        live.step_span = tracer().start_span(
            "turn.generate",
            context=ctx,
            attributes={
                "libra.turn": traj.turns,
                "libra.engine_id": engine_id,
                "libra.bucket": live.bucket,
            },
        )
        req = ev.TurnRequest(
            request_id=live.request_id,
            trajectory_id=traj.trajectory_id,
            turn_index=traj.turns,
            engine_id=engine_id,
            bucket=live.bucket,
            context_token_ids=action.context,
            max_new_tokens=action.max_new_tokens,
            min_new_tokens=action.min_new_tokens,
            temperature=self.evaluator.temperature
            if live.evaluation and self.evaluator is not None
            else self.cfg.task.temperature,
            top_p=self.cfg.task.top_p,
            min_policy_version=traj.min_policy_version,
            stop=self.stop_strings,
            priority=self.bucket_level.get(live.bucket, 0),
        )
        await self.bus.publish(
            f"{subjects.TURN_REQUEST}.{engine_id}", req, ctx=trace.set_span_in_context(live.step_span)
        )

    def _dequeued(self, live: Live) -> None:
        """Its turn leaves the bucket queue (sent, or the trajectory ended): the wait is counted."""
        if live.queued_at is not None:
            live.times.scheduler_queue_s += time.monotonic() - live.queued_at
            live.queued_at = None
        if live.queue_span is not None:
            live.queue_span.set_attribute("libra.bucket", live.bucket)
            live.queue_span.end()
            live.queue_span = None

    async def _on_turn_result(self, res: ev.TurnResult, _: Envelope) -> None:
        traj_id = self.by_request.get(res.request_id)
        if traj_id is None:
            return  # a late answer to a request we already re-sent, or another run's
        live = self.live[traj_id]
        self._forget_turn(live)
        try:
            await self._turn_result(live, res)
        finally:
            await self._drain(live.engine_id)

    async def _turn_result(self, live: Live, res: ev.TurnResult) -> None:
        traj_id = live.traj.trajectory_id
        if live.step_span is not None:
            live.step_span.set_attribute("libra.tokens", len(res.token_ids))
            live.step_span.set_attribute("libra.policy_version", res.policy_version)
            live.step_span.end()
        live.times.engine_queue_s += max(0.0, res.queue_s)
        live.times.generate_s += max(0.0, res.generate_s)
        if res.HasField("error") and res.error.code:
            self.log.warning(
                "turn_failed", trajectory_id=traj_id, code=res.error.code, reason=res.error.message
            )
            live.last_error = f"{res.engine_id}: {res.error.code}: {res.error.message}"
            if res.error.code == "handed_back" and live.pending_action is not None:
                # a draining engine gave it back: not a failure, no retry spent
                await self._send_turn(live, live.pending_action)
                return
            await self._retry_or_fail(live)
            return
        versions = list(res.token_versions) or [res.policy_version] * len(res.token_ids)
        try:
            check_turn(list(res.token_ids), list(res.logprobs), versions, res.temperature)
        except ValueError as err:
            self.log.warning("turn_result_malformed", trajectory_id=traj_id, reason=str(err))
            live.last_error = f"{res.engine_id}: malformed result: {err}"
            await self._retry_or_fail(live)
            return
        self.turns += 1
        self.metrics.turns.inc()
        self.workload.turn(time.monotonic(), len(res.token_ids), res.context_tokens, traj_id)
        eos = (
            res.finish_reason == "stop" and bool(res.token_ids) and res.token_ids[-1] == self.prompter.eos_id
        )
        step: Step | None = None
        if self.envs is not None:
            with tracer().start_as_current_span("env.step", context=trace.set_span_in_context(live.span)):
                answer = await self.envs.step(traj_id, res.text)
            if self.live.get(traj_id) is not live:
                return  # aborted meanwhile
            if isinstance(answer, PluginFailure):
                await self._fail(live, answer.code, f"turn {live.traj.turns + 1}: {answer.message}")
                return
            step = answer
        action = live.traj.on_turn(
            list(res.token_ids), list(res.logprobs), res.text, versions, eos, res.temperature, step
        )
        await self._execute(live, action)

    async def _reply(self, live: Live, action: Reply) -> None:
        """The environment's observation goes into the context; the router sees it as a small,
        successful tool return (a chance to demote or migrate the trajectory)."""
        traj = live.traj
        live.replies.append(action.text)
        obs = self.prompter.observation_ids(action.text, traj.ended_with_eos)
        self._route_after_observation(live, ToolSignal("environment", size_class(len(obs)), "success"), obs)
        await self._execute(live, traj.on_reply(obs))

    async def _retry_or_fail(self, live: Live) -> None:
        live.retries += 1
        if live.retries > self.settings.max_turn_retries or live.pending_action is None:
            why = live.last_error or "no engine answered within the turn timeout"
            await self._fail(live, "engine_unavailable", f"turn {live.traj.turns}: {why}")
            return
        await self._send_turn(live, live.pending_action)

    async def _fail(self, live: Live, code: str, message: str) -> None:
        """Ends a trajectory the infrastructure could not carry; its group will not be trained."""
        live.failure = ev.ErrorInfo(code=code, message=message[:500])
        if not live.evaluation:  # an evaluation's failures are its round's
            self.failure_codes[code] += 1
        log = self.log.info if code == "stale" else self.log.warning  # stale: routine, not a fault
        log("trajectory_failed", trajectory_id=live.traj.trajectory_id, code=code, reason=message)
        await self._finish(live, live.traj.fail())

    async def _send_tool(self, live: Live, action: CallTool) -> None:
        live.pending_tool = action
        allowed = self.cfg.task.tools
        if allowed is not None and action.request.tool not in allowed:  # never reaches a sandbox
            live.sent_at, live.step_span = time.monotonic(), None
            why = f"tool {action.request.tool!r} is not enabled; available: {', '.join(allowed)}"
            signal = ToolSignal(action.request.tool or "unknown", "small", map_sandbox_status("rejected"))
            await self._tool_returned(live, "rejected", json.dumps({"stderr": why}), signal)
            return
        live.tool_attempts += 1
        live.call_id = uuid.uuid4().hex
        live.sent_at = time.monotonic()
        live.deadline = time.monotonic() + self.cfg.task.tool_timeout_s + self.settings.tool_grace_s
        self.by_call[live.call_id] = live.traj.trajectory_id
        live.step_span = tracer().start_span(
            "tool.call",
            context=trace.set_span_in_context(live.span),
            attributes={"libra.tool": action.request.tool},
        )
        call = ev.ToolCall(
            call_id=live.call_id,
            trajectory_id=live.traj.trajectory_id,
            tool=action.request.tool,
            args_json=action.request.args_json,
            timeout_s=self.cfg.task.tool_timeout_s,
        )
        await self.bus.publish(subjects.TOOL_CALL, call, ctx=trace.set_span_in_context(live.step_span))

    async def _on_tool_return(self, ret: ev.ToolReturn, _: Envelope) -> None:
        require(bool(ret.call_id), "tool return without call_id")
        if self.sandbox.on_return(ret):
            return  # a code_tests reward's call
        traj_id = self.by_call.pop(ret.call_id, None)
        if traj_id is None:
            return
        live = self.live[traj_id]
        status = ret.status or "error"
        size = ret.size_class or size_class(ret.payload_bytes or len(ret.payload))
        tool = ret.tool or (live.pending_tool.request.tool if live.pending_tool else "unknown")
        await self._tool_returned(
            live, status, ret.payload or ret.error, ToolSignal(tool, size, map_sandbox_status(status))
        )

    async def _tool_returned(self, live: Live, status: str, payload: str, signal: ToolSignal) -> None:
        self.tool_statuses[status] += 1
        self.metrics.tool_calls.labels(status if status in KNOWN_TOOL_STATUSES else "other").inc()
        now = time.monotonic()
        live.times.tool_s += max(0.0, now - live.sent_at)
        self.workload.tool_return(now, status, max(0.0, now - live.sent_at))
        if live.step_span is not None:
            live.step_span.set_attribute("libra.tool_status", status)
            live.step_span.end()
        traj = live.traj
        if self.synthetic is not None:
            obs = self.synthetic.observation_ids(signal.size)
        else:
            text = observation(status, payload)
            if self.envs is not None:
                failed = await self.envs.tool_result(traj.trajectory_id, signal.tool, status, text)
                if self.live.get(traj.trajectory_id) is not live:
                    return  # aborted meanwhile
                if isinstance(failed, PluginFailure):
                    await self._fail(live, failed.code, f"tool_result: {failed.message}")
                    return
            preface = live.pending_tool.preface if live.pending_tool else ""
            obs = self.prompter.observation_ids(
                f"{preface}\n{text}" if preface else text, traj.ended_with_eos
            )
            request = live.pending_tool.request if live.pending_tool else None
            live.tool_log.append(
                {
                    "tool": signal.tool,
                    "args": json.loads(request.args_json) if request else {},
                    "status": status,
                    "observation": text,
                }
            )
        self._route_after_observation(live, signal, obs)
        await self._execute(live, traj.on_tool_return(status, obs))

    def _route_after_observation(self, live: Live, signal: ToolSignal, obs: list[int]) -> None:
        """C-MLFQ's decision at a tool return: the trajectory may move to another bucket."""
        traj = live.traj
        decision = self._decide(
            self.dispatch.tool_return,
            traj.trajectory_id,
            signal,
            traj.output_tokens,
            traj.context_tokens + len(obs),
            time.monotonic(),
        )
        if decision.bucket != live.bucket:
            self.log.info(
                "trajectory_migrated",
                trajectory_id=traj.trajectory_id,
                source=live.bucket,
                target=decision.bucket,
                reason=decision.reason,
            )
            live.span.add_event(
                "migrated",
                {"libra.from": live.bucket, "libra.to": decision.bucket, "libra.reason": decision.reason},
            )
            live.bucket = decision.bucket

    async def _watchdog(self) -> None:
        now = time.monotonic()
        for live in list(self.live.values()):
            if now < live.deadline:
                continue
            if live.call_id and live.call_id in self.by_call:
                self.by_call.pop(live.call_id)
                self.log.warning("tool_timeout_no_return", trajectory_id=live.traj.trajectory_id)
                if live.step_span is not None:
                    live.step_span.set_attribute("libra.tool_status", "no_answer")
                    live.step_span.end()
                if live.tool_attempts <= self.settings.max_tool_retries and live.pending_tool:
                    await self._send_tool(live, live.pending_tool)  # the sandbox may have died: again
                else:
                    await self._fail(live, "tool_sandbox_unavailable", "no tool-sandbox answered in time")
            elif live.request_id in self.by_request or (live.pending_action and not live.request_id):
                self._forget_turn(live)
                self.log.warning(
                    "turn_timeout", trajectory_id=live.traj.trajectory_id, engine_id=live.engine_id
                )
                await self._retry_or_fail(live)

    async def _finish(self, live: Live, fin: Finish) -> None:
        traj = live.traj
        self.live.pop(traj.trajectory_id, None)
        self._dequeued(live)
        if self.envs is not None:
            self.bus.spawn(self.envs.forget(traj.trajectory_id))
        self.dispatch.finish(
            traj.trajectory_id, traj.output_tokens, time.monotonic(), live.failure is not None
        )
        if live.evaluation:
            await self._evaluated(live, fin)
            return
        latency = time.monotonic() - traj.started_at
        versions = traj.versions or [0]
        msg = ev.CompletedTrajectory(
            trajectory_id=traj.trajectory_id,
            group_id=traj.group_id,
            sample_index=traj.sample_index,
            group_size=traj.group_size,
            prompt_id=traj.task.prompt_id,
            segments=[
                ev.Segment(
                    token_ids=s.token_ids,
                    logprobs=s.logprobs,
                    generated=s.generated,
                    policy_version=s.policy_version,
                    temperature=s.temperature if s.generated else 0.0,
                )
                for s in traj.segments
            ],
            reward=fin.reward,
            num_turns=traj.turns,
            min_policy_version=min(versions),
            max_policy_version=max(versions),
            tool_statuses=traj.tool_statuses,
            finish=fin.reason,
            latency_s=latency,
            final_text=traj.texts[-1] if traj.texts else "",
            failure=live.failure,
            breakdown=live.times,
        )
        with tracer().start_as_current_span("score", context=trace.set_span_in_context(live.span)) as s:
            s.set_attribute("libra.reward", fin.reward)
        live.span.set_attribute("libra.finish", fin.reason)
        live.span.set_attribute("libra.reward", fin.reward)
        live.span.set_attribute("libra.turns", traj.turns)
        # not completed until JetStream has it
        await self.bus.publish_durable_until_stored(
            subjects.TRAJ_COMPLETED,
            msg,
            msg_id=traj.trajectory_id,
            ctx=trace.set_span_in_context(live.span),
        )
        await self._durably(self.ledger.published(traj.trajectory_id, live.failure is not None))
        live.span.end()
        if live.failure is None:  # what the workload is, not what the infrastructure cut short
            self.workload.trajectory(
                time.monotonic(),
                traj.turns,
                latency,
                traj.output_tokens,
                len(traj.prompt_ids),
                traj.trajectory_id,
            )
        self.completed += 1
        self.failed += live.failure is not None
        self.metrics.trajectories.inc()
        if live.failure is not None:
            self.metrics.failed.labels(live.failure.code).inc()
        else:
            self.metrics.reward.observe(fin.reward)
            self.metrics.latency.observe(latency)
        self.rewards.append(fin.reward)
        self.log.info(
            "trajectory_completed",
            trajectory_id=traj.trajectory_id,
            finish=fin.reason,
            reward=fin.reward,
            turns=traj.turns,
            latency_s=round(latency, 3),
        )

    async def _evaluated(self, live: Live, fin: Finish) -> None:
        """An evaluation trajectory ended: its score joins its round (a failure is counted by code,
        not scored); the finished round goes to the ledger."""
        traj, rnd = live.traj, self.evaluator.running if self.evaluator is not None else None
        live.span.set_attribute("libra.reward", fin.reward)
        live.span.end()
        if rnd is None or not rnd.owns(traj.trajectory_id):
            return  # a round that is over (a late straggler)
        rnd.record(fin.reward, traj.versions, live.failure.code if live.failure is not None else "")
        if rnd.done:
            assert self.evaluator is not None
            self.evaluator.finish()
            summary = rnd.summary(self.trained_version)
            await self._durably(self.ledger.eval_done(rnd.version, summary))
            self.log.info(
                "eval_finished",
                **{k: v for k, v in summary.items() if k != "version"},
                policy_version=rnd.version,
            )


async def serve(
    common: CommonSettings, run: RunConfig, stop: asyncio.Event, stack: contextlib.AsyncExitStack
) -> None:
    from services.common.config import load_settings
    from services.common.models import load_tokenizer

    settings = load_settings(SchedulerSettings)
    cfg = run
    assert common.worker_id is not None
    prompter = Prompter(load_tokenizer(cfg.model), cfg.task.dataset)
    bus = await Bus.connect(
        common.nats_url, common.run_id, "scheduler", common.worker_id, common.nats_auth(), common.nats_tls()
    )
    stack.push_async_callback(bus.close)
    store = OwnershipStore.from_url(common.redis_url, common.run_id, common.redis_secret(), common.tls())
    stack.push_async_callback(store.close)
    svc = SchedulerService(common, settings, cfg, bus, store, prompter)
    stack.push_async_callback(svc.close)
    await svc.start()
    get_logger().info("scheduler_ready", prompts=cfg.task.num_prompts, group_size=cfg.task.group_size)
    await stop.wait()
