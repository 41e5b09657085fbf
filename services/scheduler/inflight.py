"""The scheduler's in-flight transport: every trajectory in flight, the engine request or tool call
outstanding for it with its deadline, the engines' slots those take, and the watchdog that re-sends
what was lost. It alone changes these; the rest of the shell asks it (`holds`, `state_of`)."""

from __future__ import annotations

import hashlib
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.held_context import Held
from services.common.logging import get_logger
from services.common.runconfig import RolloutConfig, TaskConfig
from services.common.tracing import tracer
from services.policy.dispatch import Dispatcher
from services.scheduler.config import SchedulerSettings
from services.scheduler.decisions import DecisionTimes
from services.scheduler.tool_calls import ToolCalls
from services.scheduler.trajectory import CallTool, Generate, Trajectory
from services.scheduler.transcript import Transcript


def trajectory_seed(run_seed: int, trajectory_id: str) -> int:
    """The sampling seed of a trajectory's turns (`TurnRequest.sampling_seed`): a 63-bit hash of
    the run's `rollout.sampling_seed` and the trajectory's id, the same for every turn of it (its
    turns sample at different positions, so at different noise) and on every resend."""
    digest = hashlib.blake2b(f"{run_seed}:{trajectory_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


@dataclass
class Live:
    """A trajectory in flight, with the span that is its trace."""

    traj: Trajectory
    span: trace.Span
    temperature: float
    """Sampling temperature of its turns (an evaluation's may differ from training's)."""
    top_p: float | None = None
    """Its own nucleus, stop strings and sampling seed (a `task.agent` call's); None: the job's."""
    stop: list[str] | None = None
    seed: int | None = None
    stream: bool = False
    """Its turns report their tokens while they generate (a `task.agent` call with `stream`)."""
    streamed: list[int] = field(default_factory=list)
    """What its turn in flight has reported of its tokens so far (TurnProgress), on this engine."""
    alternatives: int = 0
    """Further samples its turn asks for beside it (a `task.agent` call with `n` > 1)."""
    slots: int = 1
    """The engine slots its turn in flight took (itself and its alternatives)."""
    step_span: trace.Span | None = None
    request_id: str = ""
    call_id: str = ""
    engine_id: str = ""
    deadline: float = 0.0
    sent_at: float = 0.0
    seq: int = 0
    """The turn's number among those sent to its engine (TurnRequest.seq)."""
    answered_at: float = 0.0
    """When its engine first said it had answered it (EngineLoad.answered_ids; 0: not yet)."""
    missing: int = 0
    lost: int = 0
    """Its turns that vanished on the way to an engine or back (the first is re-sent for free)."""
    retries: int = 0
    pending_action: Generate | None = None
    pending_tool: CallTool | None = None
    tool_attempts: int = 0
    failure: ev.ErrorInfo | None = None
    last_error: str = ""
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
    partial: PartialTurn | None = None
    """What its turn generated before an engine handed it back (drained): the turn goes on from
    there on another engine, and these tokens open its result."""
    held: Held | None = None
    """The engine that served its last turn, and what of its context it holds since."""
    sent_offset: int = 0
    """Its turn in flight went as a delta from this many tokens (TurnRequest.context_offset)."""
    prompt_messages: list[dict[str, Any]] | None = None
    """Its prompt as the messages that made it, where not the task's (a `task.agent`'s first call)."""
    transcript: Transcript = field(default_factory=Transcript)
    """Its text as it happened, for the job's samples (services/scheduler/transcript.py)."""

    @property
    def trajectory_id(self) -> str:
        return self.traj.trajectory_id

    @property
    def min_policy_version(self) -> int:
        """The oldest weights its next request may run on: its trajectory's, and no older than a
        handed-back part of the turn (weights only move forward within a trajectory)."""
        done = self.partial.versions[-1] if self.partial is not None and self.partial.versions else -1
        return max(self.traj.min_policy_version, done)


@dataclass
class PartialTurn:
    """Tokens of a turn an engine gave back before it ended (their logprobs and weight versions)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def add(self, res: ev.TurnResult, versions: list[int]) -> None:
        self.token_ids += list(res.token_ids)
        self.logprobs += list(res.logprobs)
        self.versions += versions


Fail = Callable[[Live, str, str], Awaitable[None]]
"""Ends a trajectory the infrastructure could not carry (live, code, message)."""


class Outstanding:
    """The turns sent to engines and not yet answered: request id -> trajectory id, and the same by
    engine, kept together (a report from one of 1,024 engines must not scan every turn)."""

    def __init__(self) -> None:
        self._traj: dict[str, tuple[str, str]] = {}
        self._by_engine: dict[str, dict[str, str]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._traj

    def __len__(self) -> int:
        return len(self._traj)

    def get(self, request_id: str) -> str | None:
        found = self._traj.get(request_id)
        return found[0] if found is not None else None

    def add(self, request_id: str, traj_id: str, engine_id: str) -> None:
        self.pop(request_id)
        self._traj[request_id] = (traj_id, engine_id)
        self._by_engine.setdefault(engine_id, {})[request_id] = traj_id

    def pop(self, request_id: str, default: str | None = None) -> str | None:
        found = self._traj.pop(request_id, None)
        if found is None:
            return default
        traj_id, engine_id = found
        turns = self._by_engine[engine_id]
        del turns[request_id]
        if not turns:
            del self._by_engine[engine_id]
        return traj_id

    def on(self, engine_id: str) -> dict[str, str]:
        """`engine_id`'s turns: request id -> trajectory id (a view: copy it to change the map)."""
        return self._by_engine.get(engine_id, {})


def turn_request(
    live: Live, action: Generate, bucket: str, priority: int, held: Held | None, offset: int
) -> ev.TurnRequest:
    """The request for `live`'s turn at its engine (`live.engine_id`, `live.request_id`, `live.seq`
    set), its context from `offset` on where the engine holds the rest (`held`); the caller adds
    the job's sampling defaults (top_p, stop strings, seed) where the trajectory has none."""
    traj = live.traj
    return ev.TurnRequest(
        request_id=live.request_id,
        trajectory_id=traj.trajectory_id,
        turn_index=traj.turns,
        engine_id=live.engine_id,
        bucket=bucket,
        context_token_ids=action.context[offset:],
        context_offset=offset,
        context_digest=held.digest if held is not None and offset else 0,
        max_new_tokens=action.max_new_tokens,
        min_new_tokens=action.min_new_tokens,
        temperature=live.temperature,
        min_policy_version=live.min_policy_version,
        priority=priority,
        stream=live.stream,
        alternatives=live.alternatives,
        # a continued turn's context ends with what it kept; its alternatives start again before it
        alternatives_prompt=len(action.context) - len(live.partial.token_ids) if live.partial else 0,
        group_id=traj.group_id,
        seq=live.seq,
        prompt_id=traj.task.prompt_id,
    )


class InFlight:
    def __init__(
        self,
        bus: Bus,
        dispatch: Dispatcher,
        settings: SchedulerSettings,
        rollout: RolloutConfig,
        task: TaskConfig,
        stop_strings: list[str],
        fail: Fail,
        calls: ToolCalls | None = None,
    ):
        self.bus, self.dispatch, self.settings = bus, dispatch, settings
        self.task, self.sampling_seed = task, rollout.sampling_seed
        self.calls = calls if calls is not None else ToolCalls()
        """Tool calls out at the sandbox -> who waits (this scheduler's one registry of them)."""
        self.stop_strings = stop_strings
        self.fail = fail
        self.log = get_logger(component="scheduler")
        self.bucket_level = {b.name: i for i, b in enumerate(rollout.buckets)}
        self._live: dict[str, Live] = {}
        self.requests = Outstanding()
        """Engine request id -> the trajectory whose turn it is (absent: answered, lost, given up),
        indexed by engine too: an engine's load report looks at its own turns only."""
        self._sent_to: dict[str, int] = {}
        """Engine id -> turns sent to it so far (the last TurnRequest.seq)."""
        self._seq_base = time.time_ns() // 1000
        """Where this scheduler's numbers start: at its start in microseconds, so they run past
        every number an earlier scheduler of the job sent (a standby taking over, a restart). An
        engine's `last_seq` still at the earlier one's would otherwise say that it read this
        one's first turns before it had, and a busy engine's unread turns would count as lost."""
        self.times = DecisionTimes()
        """How long its routing decisions take."""
        self.context_tokens = {"sent": 0, "held": 0}
        """Context tokens turn requests carried, and those their engines held already."""

    # the trajectories ---------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._live)

    def all(self) -> list[Live]:
        return list(self._live.values())

    def add(self, live: Live) -> None:
        self._live[live.trajectory_id] = live

    def get(self, trajectory_id: str) -> Live | None:
        return self._live.get(trajectory_id)

    def holds(self, live: Live) -> bool:
        """Still in flight (False: it ended meanwhile, e.g. its group could no longer be trained)."""
        return self._live.get(live.trajectory_id) is live

    def abort(self, live: Live) -> None:
        """Gives up whatever it waits for (its engine slot frees at once); `end` follows."""
        self.forget_turn(live)
        self.calls.forget(live.call_id)
        if live.step_span is not None:
            live.step_span.end()

    def end(self, live: Live, now: float) -> None:
        """It finished or failed: nothing of it stays in flight, and the policy learns from it."""
        self._live.pop(live.trajectory_id, None)
        self._dequeued(live)
        self.dispatch.finish(live.trajectory_id, live.traj.output_tokens, now, live.failure is not None)

    def state_of(self, live: Live) -> str:
        if live.scoring:
            return "scoring"
        if live.call_id and live.call_id in self.calls:
            return "tool"
        if live.request_id and live.request_id in self.requests:
            return "generating"
        if live.trajectory_id in self.dispatch.queued:
            return "queued"
        return "waiting_for_engine"

    def oldest(self, n: int, now: float) -> list[ev.InFlight]:
        """The `n` trajectories in flight the longest, and what each is doing (for `libra status`)."""
        oldest = sorted(self._live.values(), key=lambda lv: lv.traj.started_at)[:n]
        return [
            ev.InFlight(
                trajectory_id=lv.trajectory_id,
                group_id=lv.traj.group_id,
                state=self.state_of(lv),
                engine_id=lv.engine_id if lv.request_id in self.requests else "",
                turns=lv.traj.turns,
                age_s=now - lv.traj.started_at,
                idle_s=now - lv.sent_at if lv.sent_at else 0.0,
            )
            for lv in oldest
        ]

    # turns --------------------------------------------------------------------------------------

    async def send_turn(self, live: Live, action: Generate, avoid: str | None = None) -> None:
        """Places the turn: on an engine with a free slot the policy picks (not `avoid` while
        another serves), else in its bucket's queue until a slot frees (`drain`)."""
        live.pending_action = action
        if not self.dispatch.engines:  # none serving: the watchdog sends it again in a second
            live.request_id = ""
            live.deadline = time.monotonic() + 1.0
            return
        # its KV, were it and its alternatives (an agent's n > 1) to use their whole budgets
        live.slots = 1 + live.alternatives  # it runs that many sequences on its engine
        need = (len(action.context) + action.max_new_tokens) * live.slots
        began = time.perf_counter()
        engine_id = self.times.decide(
            self.dispatch.place, live.trajectory_id, time.monotonic(), avoid, need, live.slots
        )
        if engine_id is None:
            live.deadline = math.inf  # queued: waits for a slot, however long the tail ahead of it
            if live.queued_at is None:
                live.queued_at = time.monotonic()
                live.queue_span = tracer().start_span(
                    "turn.queued",
                    context=trace.set_span_in_context(live.span),
                    attributes={"libra.turn": live.traj.turns, "libra.bucket": self.bucket_of(live)},
                )
            return
        await self._dispatch(live, engine_id, began)

    async def drain(self, engine_id: str) -> None:
        """Gives the engine's free slots to the turns the policy picks from the queues."""
        while True:
            began = time.perf_counter()
            traj_id = self.times.decide(self.dispatch.next_for, engine_id, time.monotonic(), poll=True)
            if traj_id is None:
                return
            live = self._live.get(traj_id)
            if live is None or live.pending_action is None:
                self.dispatch.release(engine_id, live.slots if live is not None else 1)
                continue
            await self._dispatch(live, engine_id, began)

    async def drain_all(self) -> None:
        """`drain` of every engine with a free slot, while turns wait in the queues."""
        for engine_id in self.dispatch.free_engines():
            await self.drain(engine_id)

    def turn_answered(self, request_id: str, engine_id: str) -> Live | None:
        """The trajectory whose turn `engine_id` answers (its engine slot frees), or None: a late
        answer to a request already re-sent, another run's, or one sent to another engine."""
        traj_id = self.requests.get(request_id)
        if traj_id is None:
            return None
        live = self._live[traj_id]
        if live.engine_id != engine_id:
            self.log.warning(
                "turn_result_from_another_engine",
                request_id=request_id,
                sent_to=live.engine_id,
                from_=engine_id,
            )
            return None
        self.forget_turn(live)
        return live

    def progress(self, msg: ev.TurnProgress) -> Live | None:
        """The trajectory whose turn in flight `msg` reports on, with its tokens so far (`streamed`)
        extended, or None: not a streamed turn in flight on that engine, or a report out of order."""
        traj_id = self.requests.get(msg.request_id)
        live = self._live.get(traj_id) if traj_id is not None else None
        if live is None or not live.stream or live.engine_id != msg.engine_id:
            return None
        if msg.offset != len(live.streamed):  # one lost on the way: the result has them all
            return None
        budget = live.pending_action.max_new_tokens if live.pending_action is not None else 0
        if len(live.streamed) + len(msg.token_ids) > budget:  # more than it may make: not believed
            return None
        live.streamed += msg.token_ids
        return live

    async def retry_or_fail(
        self, live: Live, code: str = "engine_unavailable", avoid: str | None = None
    ) -> None:
        """Sends the turn again (to another engine than `avoid` where there is one), or, out of
        retries, ends the trajectory with `code`."""
        live.retries += 1
        if live.retries > self.settings.max_turn_retries or live.pending_action is None:
            why = live.last_error or "no engine answered within the turn timeout"
            await self.fail(live, code, f"turn {live.traj.turns}: {why}")
            return
        await self.send_turn(live, live.pending_action, avoid=avoid)

    def forget_turn(self, live: Live) -> None:
        """The turn in flight is over (answered, lost or timed out): its engine slot frees."""
        if self.requests.pop(live.request_id, None) is not None:
            self.dispatch.release(live.engine_id, live.slots)

    async def _dispatch(self, live: Live, engine_id: str, began: float) -> None:
        """Sends the turn to `engine_id`, placed by a decision that began at `began`
        (`time.perf_counter`)."""
        traj, action = live.traj, live.pending_action
        assert action is not None
        self._dequeued(live)
        bucket = self.bucket_of(live)
        live.request_id = uuid.uuid4().hex
        live.engine_id = engine_id
        live.sent_at = time.monotonic()
        first = not self._sent_to  # this scheduler's first turn: where a takeover ends (the log)
        live.seq = self._sent_to[engine_id] = self._sent_to.get(engine_id, self._seq_base) + 1
        live.answered_at = 0.0
        live.streamed = []
        live.deadline = time.monotonic() + self.settings.turn_timeout(action.max_new_tokens)
        self.requests.add(live.request_id, traj.trajectory_id, engine_id)
        ctx = trace.set_span_in_context(live.span)
        live.step_span = tracer().start_span(
            "turn.generate",
            context=ctx,
            attributes={"libra.turn": traj.turns, "libra.engine_id": engine_id, "libra.bucket": bucket},
        )
        held = live.held if self.settings.context_deltas else None
        offset = live.sent_offset = held.offset_for(engine_id, action.context) if held is not None else 0
        req = turn_request(live, action, bucket, self.bucket_level.get(bucket, 0), held, offset)
        req.top_p = live.top_p or self.task.top_p
        req.stop.extend(self.stop_strings if live.stop is None else live.stop)
        req.sampling_seed = (
            trajectory_seed(self.sampling_seed, traj.trajectory_id) if live.seed is None else live.seed
        )
        self.context_tokens["sent"] += len(req.context_token_ids)
        self.context_tokens["held"] += offset
        await self.bus.publish(
            f"{subjects.TURN_REQUEST}.{engine_id}", req, ctx=trace.set_span_in_context(live.step_span)
        )
        self.times.dispatched(began)
        if first:
            self.log.info("first_turn_sent", engine_id=engine_id, trajectory_id=traj.trajectory_id)

    def bucket_of(self, live: Live) -> str:
        """The bucket its next turn goes to: the dispatcher's router holds it ("" once it ended)."""
        return self.dispatch.bucket_of(live.trajectory_id) or ""

    def _dequeued(self, live: Live) -> None:
        """Its turn leaves the bucket queue (sent, or the trajectory ended): the wait is counted."""
        if live.queued_at is not None:
            live.times.scheduler_queue_s += time.monotonic() - live.queued_at
            live.queued_at = None
        if live.queue_span is not None:
            live.queue_span.set_attribute("libra.bucket", self.bucket_of(live))
            live.queue_span.end()
            live.queue_span = None

    # tool calls ---------------------------------------------------------------------------------

    async def send_tool(self, live: Live, action: CallTool) -> None:
        live.pending_tool = action
        live.tool_attempts += 1
        live.call_id = uuid.uuid4().hex
        live.sent_at = time.monotonic()
        live.deadline = time.monotonic() + self.task.tool_timeout_s + self.settings.tool_grace_s
        self.calls.expect(live.call_id, live.trajectory_id)
        live.step_span = tracer().start_span(
            "tool.call",
            context=trace.set_span_in_context(live.span),
            attributes={"libra.tool": action.request.tool},
        )
        call = ev.ToolCall(
            call_id=live.call_id,
            trajectory_id=live.trajectory_id,
            tool=action.request.tool,
            args_json=action.request.args_json,
            timeout_s=self.task.tool_timeout_s,
        )
        await self.bus.publish(subjects.TOOL_CALL, call, ctx=trace.set_span_in_context(live.step_span))

    def tool_answered(self, ret: ev.ToolReturn) -> Live | None:
        """The trajectory that waited for this tool return, or None (a reward's code run, answered
        already, or not ours)."""
        traj_id = self.calls.answered(ret)
        return None if traj_id is None else self._live.get(traj_id)

    async def watchdog(self, now: float) -> None:
        """What passed its deadline: a tool call no sandbox answered is sent again (or fails its
        trajectory), a turn no engine answered is retried elsewhere (or fails it)."""
        for live in list(self._live.values()):
            if now < live.deadline:
                continue
            if live.call_id and live.call_id in self.calls:
                self.calls.forget(live.call_id)
                self.log.warning("tool_timeout_no_return", trajectory_id=live.trajectory_id)
                if live.step_span is not None:
                    live.step_span.set_attribute("libra.tool_status", "no_answer")
                    live.step_span.end()
                if live.tool_attempts <= self.settings.max_tool_retries and live.pending_tool:
                    await self.send_tool(live, live.pending_tool)  # the sandbox may have died: again
                else:
                    await self.fail(live, "tool_sandbox_unavailable", "no tool-sandbox answered in time")
            elif live.request_id in self.requests or (live.pending_action and not live.request_id):
                self.forget_turn(live)
                self.log.warning("turn_timeout", trajectory_id=live.trajectory_id, engine_id=live.engine_id)
                await self.retry_or_fail(live)
