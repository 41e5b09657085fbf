"""Each trajectory's agent loop: the state machine (`Trajectory`) says what comes next, the episode
answers between turns, the in-flight transport carries turns and tool calls, completion ends it."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from opentelemetry import trace

from services.common.bus import Bus, Envelope
from services.common.contracts import ev
from services.common.errors import FencedOut, require
from services.common.held_context import Held
from services.common.logging import get_logger
from services.common.runconfig import TaskConfig
from services.common.tracing import tracer
from services.policy.dispatch import Dispatcher
from services.policy.prefix_tree import ToolSignal, map_sandbox_status, size_class
from services.scheduler.completion import Completion
from services.scheduler.episodes import Episode, SampledTurn
from services.scheduler.inflight import InFlight, Live
from services.scheduler.plugins import PluginFailure
from services.scheduler.prompting import Prompter
from services.scheduler.results import TurnResults
from services.scheduler.rewards import SandboxClient
from services.scheduler.roster import Roster
from services.scheduler.task import Task
from services.scheduler.trajectory import (
    Action,
    CallTool,
    Finish,
    Generate,
    Reply,
    ScriptedTurn,
    Trajectory,
    check_turn,
)
from services.scheduler.workload import WorkloadWindow

KNOWN_TOOL_STATUSES = ("ok", "error", "timeout", "killed", "rejected")
"""Tool statuses with their own metric label (anything else a sandbox sends counts as `other`)."""


def route_after_observation(
    inflight: InFlight,
    dispatch: Dispatcher,
    log: Any,
    live: Live,
    signal: ToolSignal,
    obs: list[int],
    rewritten: bool,
) -> None:
    """C-MLFQ's decision at a tool return: the trajectory may move to another bucket.
    `rewritten`: `obs` replaces the context (a conversation an agent rewrote)."""
    traj = live.traj
    before = inflight.bucket_of(live)
    decision = inflight.times.decide(
        dispatch.tool_return,
        traj.trajectory_id,
        signal,
        traj.output_tokens,
        (0 if rewritten else traj.context_tokens) + len(obs),
        time.monotonic(),
    )
    if decision.bucket != before:
        log.info(
            "trajectory_migrated",
            trajectory_id=traj.trajectory_id,
            source=before,
            target=decision.bucket,
            reason=decision.reason,
        )
        live.span.add_event(
            "migrated",
            {"libra.from": before, "libra.to": decision.bucket, "libra.reason": decision.reason},
        )


def new_trajectory(
    job_task: TaskConfig,
    ids: tuple[str, str, int, int],
    task: Task,
    prompt_ids: list[int],
    script: list[ScriptedTurn] | None,
    launch_version: int,
) -> Trajectory:
    """Trajectory `ids` = (trajectory id, group id, sample index, group size) of `task`, within
    the job's turn, token and context limits (`job_task`), starting now."""
    trajectory_id, group_id, index, size = ids
    return Trajectory(
        trajectory_id=trajectory_id,
        group_id=group_id,
        sample_index=index,
        group_size=size,
        task=task,
        prompt_ids=prompt_ids,
        max_turns=len(script) if script else job_task.max_turns,
        max_new_tokens=job_task.max_new_tokens,
        max_context_tokens=job_task.max_context_tokens,
        started_at=time.monotonic(),
        script=script,
        launch_version=launch_version,
        tool_bonus=job_task.tool_bonus,
    )


class TrajectoryDriver:
    def __init__(
        self,
        common_run_id: str,
        task: TaskConfig,
        bus: Bus,
        prompter: Prompter,
        dispatch: Dispatcher,
        inflight: InFlight,
        roster: Roster,
        episode: Episode,
        completion: Completion,
        sandbox: SandboxClient,
        workload: WorkloadWindow,
        metrics: Any,
        vocab_size: int | None = None,
        newest_version: Callable[[int], Awaitable[int]] | None = None,
        handovers: int = 8,
    ):
        """`vocab_size` and `newest_version` (the newest weight version the trainer has made, asked
        with the version a result claims) bound what an engine's turn result may say (`results`);
        `handovers`: finished trajectories stored for the trainer at once (SchedulerSettings)."""
        self.run_id, self.task, self.bus, self.prompter = common_run_id, task, bus, prompter
        self.results = TurnResults(roster, vocab_size, newest_version)
        self.dispatch, self.inflight, self.episode, self.completion = dispatch, inflight, episode, completion
        self.roster = roster
        """The engines: where an engine's invalid results are counted."""
        self.sandbox, self.workload, self.metrics = sandbox, workload, metrics
        self.log = get_logger(component="scheduler")
        self.turns = 0
        self.handed_back = 0
        """Turns a draining engine gave back."""
        self._handing = asyncio.Semaphore(handovers)
        self.tool_statuses: Counter[str] = Counter()
        for status in (*KNOWN_TOOL_STATUSES, "other"):  # every series exists from the start, at 0
            self.metrics.tool_calls.labels(status)

    def start(
        self,
        ids: tuple[str, str, int, int],
        task: Task,
        prompt_ids: list[int],
        script: list[ScriptedTurn] | None,
        launch_version: int,
        temperature: float,
        evaluation: bool = False,
    ) -> None:
        """Starts trajectory `ids` = (trajectory id, group id, sample index, group size)."""
        traj = new_trajectory(self.task, ids, task, prompt_ids, script, launch_version)
        traj.scored_outside = self.completion.scorer is not None
        traj.builtin_reward = self.episode.builtin_reward
        span = tracer().start_span(
            "evaluation" if evaluation else "trajectory",
            attributes={
                "libra.trajectory_id": traj.trajectory_id,
                "libra.group_id": traj.group_id,
                "libra.prompt_id": task.prompt_id,
                "libra.run_id": self.run_id,
            },
        )
        self.dispatch.admit(traj.trajectory_id, task.prompt_id, time.monotonic())
        live = Live(traj, span, temperature, evaluation=evaluation)
        self.inflight.add(live)
        if not evaluation:
            self.workload.launched(traj.trajectory_id)
        self.bus.spawn(self._begin(live))

    async def _begin(self, live: Live) -> None:
        """The episode's reset (it may bring its own prompt), then the first turn."""
        live.deadline = math.inf  # an environment's own timeout bounds its reset
        failed = await self.episode.reset(live)
        if not self.inflight.holds(live):
            return  # aborted meanwhile
        if failed is not None:
            await self.fail(live, failed.code, failed.message)
            return
        await self._execute(live, live.traj.first_action())

    async def _execute(self, live: Live, action: Action) -> None:
        if isinstance(action, Generate):
            await self.inflight.send_turn(live, action)
        elif isinstance(action, CallTool):
            await self._send_tool(live, action)
        elif isinstance(action, Reply):
            await self._reply(live, action)
        elif isinstance(action, Finish):
            if self.completion.needs_score(live, action):
                live.scoring, live.deadline = True, math.inf  # the reward's own timeout bounds it
                self.bus.spawn(self._score(live, action))
            else:
                await self._finish(live, action)

    async def _score(self, live: Live, fin: Finish) -> None:
        result = await self.completion.score(live, fin)
        if not self.inflight.holds(live):
            return  # aborted meanwhile (its group could no longer be trained)
        if isinstance(result, PluginFailure):
            await self.fail(live, result.code, result.message)
        else:
            await self._finish(live, result)

    async def on_turn_result(self, res: ev.TurnResult, _: Envelope) -> None:
        live = self.inflight.turn_answered(res.request_id, res.engine_id)  # (the bus checked who sent it)
        if live is None:
            return  # a late answer to a request we already re-sent, or another run's
        try:
            await self._turn_result(live, res)
        finally:
            await self.inflight.drain(live.engine_id)

    async def on_turn_progress(self, msg: ev.TurnProgress, _: Envelope) -> None:
        """A streamed turn's tokens so far (from the engine it was sent to: the bus checked the
        sender): its episode shows them (an agent's streamed call reads them as they come)."""
        vocab = self.results.vocab_size
        if vocab is not None and not all(0 <= t < vocab for t in msg.token_ids):
            return  # tokens no model has: as a result they would be refused, and quarantined
        live = self.inflight.progress(msg)
        if live is not None:
            before = live.partial.token_ids if live.partial is not None else []
            self.episode.progress(live, before + live.streamed)

    async def _turn_result(self, live: Live, res: ev.TurnResult) -> None:
        traj_id = live.trajectory_id
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
            if res.error.code == "context_unknown" and live.sent_offset and live.pending_action is not None:
                # its engine no longer holds what the delta was sent against (restarted, evicted
                # it): not a failure, no retry spent; the whole context goes again
                live.held = None
                await self.inflight.send_turn(live, live.pending_action)
                return
            if res.error.code == "handed_back" and live.pending_action is not None:
                # a draining engine gave it back: not a failure, no retry spent; what it generated
                # so far is kept, and the turn goes on from there (the engine forgot its context)
                self.handed_back += 1
                live.held = None
                await self.inflight.send_turn(
                    live, await self.results.continued(live, live.pending_action, res)
                )
                return
            await self.inflight.retry_or_fail(live)
            return
        versions = list(res.token_versions) or [res.policy_version] * len(res.token_ids)
        try:
            await self.results.check(live, res, versions)
            others = await self.results.alternatives(live, res)
        except ValueError as err:
            await self.roster.invalid_result(live, res.engine_id, str(err))
            return
        self.roster.valid_result(res.engine_id)
        if live.pending_action is not None:
            live.held = Held.after(res.engine_id, live.pending_action.context, res.token_ids)
        token_ids, logprobs, text = list(res.token_ids), list(res.logprobs), res.text
        if live.partial is not None:  # the turn began on an engine that handed it back
            part = live.partial
            token_ids, logprobs = part.token_ids + token_ids, part.logprobs + logprobs
            versions = part.versions + versions
            text = self.prompter.tok.decode(token_ids, skip_special_tokens=True)
        try:
            check_turn(token_ids, logprobs, versions, res.temperature)
        except ValueError as err:
            self.log.warning("turn_result_malformed", trajectory_id=traj_id, reason=str(err))
            live.last_error = f"{res.engine_id}: malformed result: {err}"
            await self.inflight.retry_or_fail(live)
            return
        live.partial = None
        self.turns += 1
        self.metrics.turns.inc()
        self.workload.turn(time.monotonic(), len(token_ids), res.context_tokens, traj_id)
        alternatives = [
            SampledTurn(ids, lps, alt.text, alt.finish_reason, vs)
            for (ids, lps, vs), alt in zip(others, res.alternatives, strict=True)
        ]
        turn = SampledTurn(token_ids, logprobs, text, res.finish_reason, versions, alternatives)
        step = await self.episode.step(live, turn)
        if not self.inflight.holds(live):
            return  # aborted meanwhile
        turn = self.episode.taken(live) or turn  # an agent went on from one of the alternatives
        live.transcript.assistant(turn.text, len(turn.token_ids), turn.versions, turn.finish_reason)
        if isinstance(step, PluginFailure):
            await self.fail(live, step.code, step.message)
            return
        action = live.traj.on_turn(
            turn.token_ids,
            turn.logprobs,
            turn.text,
            turn.versions,
            self.prompter.ended_with_eos(turn.token_ids, turn.finish_reason),
            res.temperature,
            step,
            cut=turn.finish_reason == "length",
        )
        await self._execute(live, action)

    async def _reply(self, live: Live, action: Reply) -> None:
        """The environment's observation goes into the context; the router sees it as a small,
        successful tool return (a chance to demote or migrate the trajectory)."""
        traj = live.traj
        live.replies.append(action.text)
        live.transcript.environment(action.text)
        obs = self.episode.reply_ids(live, action.text)
        rewritten = self.episode.reply_rewrites(live)
        route_after_observation(
            self.inflight, self.dispatch, self.log, live, self.episode.reply_signal(live, obs), obs, rewritten
        )
        await self._execute(live, traj.on_reply(obs, rewritten))

    async def fail(self, live: Live, code: str, message: str) -> None:
        """Ends a trajectory the infrastructure could not carry; its group will not be trained."""
        self.completion.failure(live, code, message)
        await self._finish(live, live.traj.fail())

    async def _send_tool(self, live: Live, action: CallTool) -> None:
        allowed = self.task.tools
        if allowed is not None and action.request.tool not in allowed:  # never reaches a sandbox
            live.pending_tool = action
            live.sent_at, live.step_span = time.monotonic(), None
            why = f"tool {action.request.tool!r} is not enabled; available: {', '.join(allowed)}"
            tracer().start_span(
                "tool.rejected",
                context=trace.set_span_in_context(live.span),
                attributes={"libra.tool": action.request.tool or "unknown", "libra.reason": why},
            ).end()
            signal = ToolSignal(action.request.tool or "unknown", "small", map_sandbox_status("rejected"))
            await self._tool_returned(live, "rejected", json.dumps({"stderr": why}), signal)
            return
        await self.inflight.send_tool(live, action)

    async def on_tool_return(self, ret: ev.ToolReturn, _: Envelope) -> None:
        require(bool(ret.call_id), "tool return without call_id")
        live = self.inflight.tool_answered(ret)  # None for a code_tests reward's call too
        if live is None:
            return
        status = ret.status or "error"
        size = ret.size_class or size_class(ret.payload_bytes or len(ret.payload))
        tool = ret.tool or (live.pending_tool.request.tool if live.pending_tool else "unknown")
        await self._tool_returned(
            live, status, ret.payload or ret.error, ToolSignal(tool, size, map_sandbox_status(status))
        )

    async def _tool_returned(self, live: Live, status: str, payload: str, signal: ToolSignal) -> None:
        pending = live.pending_tool
        live.transcript.tool(signal.tool, pending.request.args if pending else {}, status, payload)
        self.tool_statuses[status] += 1
        self.metrics.tool_calls.labels(status if status in KNOWN_TOOL_STATUSES else "other").inc()
        now = time.monotonic()
        live.times.tool_s += max(0.0, now - live.sent_at)
        self.workload.tool_return(now, status, max(0.0, now - live.sent_at))
        if live.step_span is not None:
            live.step_span.set_attribute("libra.tool_status", status)
            live.step_span.end()
        obs = await self.episode.tool_observation(live, status, payload, signal)
        if not self.inflight.holds(live):
            return  # aborted meanwhile
        if isinstance(obs, PluginFailure):
            await self.fail(live, obs.code, obs.message)
            return
        route_after_observation(self.inflight, self.dispatch, self.log, live, signal, obs, False)
        await self._execute(live, live.traj.on_tool_return(status, obs))

    async def abort_groups(self, doomed: set[str], why: Callable[[str], str]) -> None:
        """Ends the in-flight (training) trajectories of these groups as failed `stale`, `why(group)`."""
        for live in [lv for lv in self.inflight.all() if lv.traj.group_id in doomed and not lv.evaluation]:
            self.inflight.abort(live)
            await self.fail(live, "stale", why(live.traj.group_id))

    async def _finish(self, live: Live, fin: Finish) -> None:
        """Ends the trajectory here and hands it to the trainer in a task of its own: JetStream
        storing a long trajectory (hundreds of kB of tokens and logprobs) took 0.1-0.6 s at 512
        engines, and on the turn results' path every result behind it waited (seconds at 1,024).
        At most `handovers` at once (`LIBRA_SCHEDULER_HANDOVERS`): unbounded, hundreds of stores
        at 1,024 engines timed out and were retried together, and the scheduler, busy with them,
        dropped turn results. One still on its way when the scheduler stops is not waited for: the
        ledger does not name it published, so the job's next scheduler re-issues it (the job's end
        needs it no more)."""
        self.inflight.end(live, time.monotonic())
        self.episode.forget(live)
        self.bus.spawn(self._hand_over(live, fin))

    async def _hand_over(self, live: Live, fin: Finish) -> None:
        try:
            async with self._handing:
                await self.completion.publish(live, fin)
        except FencedOut:  # its successor re-issues it from the ledger
            self.log.warning(
                "trajectory_not_handed_over", trajectory_id=live.trajectory_id, reason="fenced out"
            )
