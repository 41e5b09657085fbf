"""Where a trajectory ends: scored by `task.reward` when its task asks for it, then published
durably for the trainer (an evaluation trajectory joins its round instead), and counted."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from opentelemetry import trace

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.logging import get_logger
from services.common.runconfig import TaskConfig
from services.common.tracing import tracer
from services.scheduler.evaluation import Evaluator
from services.scheduler.inflight import Live
from services.scheduler.ledger import Ledger, durably
from services.scheduler.plugins import PluginFailure
from services.scheduler.rewards import Scorer, overlong_penalty, reward_trajectory
from services.scheduler.trajectory import Finish
from services.scheduler.transcript import cut, prompt_of
from services.scheduler.user_code import BrokenUserCode
from services.scheduler.workload import WorkloadWindow


class Completion:
    def __init__(
        self,
        bus: Bus,
        ledger: Ledger,
        workload: WorkloadWindow,
        metrics: Any,
        scorer: Scorer | None,
        evaluator: Evaluator | None,
        trained_version: Callable[[], int],
        task: TaskConfig,
    ):
        self.bus, self.ledger, self.workload, self.metrics = bus, ledger, workload, metrics
        self.task = task
        self.scorer, self.evaluator = scorer, evaluator
        self.trained_version = trained_version
        self.log = get_logger(component="scheduler")
        self.completed = 0
        self.failed = 0
        self.rewards: list[float] = []
        self.failure_codes: Counter[str] = Counter()
        self.user_code = BrokenUserCode()
        self.broken: str | None = None
        """Why the job's own code is broken (`user_code.py`): the scheduler then fails the job."""

    def needs_score(self, live: Live, fin: Finish) -> bool:
        return fin.needs_score and self.scorer is not None and live.failure is None

    async def score(self, live: Live, fin: Finish) -> Finish | PluginFailure:
        """Scores a finished trajectory with `task.reward` (off the event loop); a reward that
        fails is a typed failure, so it is never trained on as a negative sample."""
        assert self.scorer is not None
        traj = live.traj
        with tracer().start_as_current_span("reward", context=trace.set_span_in_context(live.span)) as span:
            result = await self.scorer.score(
                response=traj.texts[-1] if traj.texts else "",
                answer=traj.task.answer,
                sample=traj.task.row(),
                trajectory=reward_trajectory(
                    list(traj.texts), live.tool_log, live.replies, fin.reason, traj.task.prompt_id
                ),
            )
            if isinstance(result, PluginFailure):
                span.set_attribute("libra.reward_failure", result.code)
        return result if isinstance(result, PluginFailure) else Finish(fin.reason, result)

    def failure(self, live: Live, code: str, message: str) -> None:
        """Records why the infrastructure could not carry it; its group will not be trained."""
        live.failure = ev.ErrorInfo(code=code, message=message[:500])
        if not live.evaluation:  # an evaluation's failures are its round's
            self.failure_codes[code] += 1
        log = self.log.info if code == "stale" else self.log.warning  # stale: routine, not a fault
        log("trajectory_failed", trajectory_id=live.trajectory_id, code=code, reason=message)

    async def publish(self, live: Live, fin: Finish) -> None:
        """Hands the trajectory to the trainer: not completed until JetStream has it."""
        if live.evaluation:
            await self._evaluated(live, fin)
            return
        traj = live.traj
        failure = live.failure
        why = (
            self.user_code.ended(failure.code, failure.message)
            if failure is not None
            else self.user_code.ended()
        )
        self.broken = self.broken or why
        latency = time.monotonic() - traj.started_at
        versions = traj.versions or [0]
        penalty = self._overlong_penalty(live)
        fin = Finish(fin.reason, fin.reward + penalty, fin.needs_score)
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
                    starts_sequence=s.starts_sequence,
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
            truncated=traj.truncated,
            overlong_penalty=penalty,
            completed_at=time.time(),
        )
        with tracer().start_as_current_span("score", context=trace.set_span_in_context(live.span)) as s:
            s.set_attribute("libra.reward", fin.reward)
        live.span.set_attribute("libra.finish", fin.reason)
        live.span.set_attribute("libra.reward", fin.reward)
        live.span.set_attribute("libra.turns", traj.turns)
        await self.ledger.guard()  # a scheduler fenced out of its role hands the trainer nothing
        await self.bus.publish_durable_until_stored(
            subjects.TRAJ_COMPLETED,
            msg,
            msg_id=traj.trajectory_id,
            ctx=trace.set_span_in_context(live.span),
        )
        await durably(self.ledger.published(traj.trajectory_id, live.failure is not None), self.log)
        live.span.end()
        self._count(live, fin, latency)
        await self._sample(live, msg)

    async def _sample(self, live: Live, msg: ev.CompletedTrajectory) -> None:
        """The trajectory's text for the job's samples: best effort (core NATS), never at the cost
        of the trajectory."""
        traj = live.traj
        head = {
            "prompt": prompt_of(live.prompt_messages or traj.task.messages, traj.task.question),
            "answer": cut(str(traj.task.answer)) if traj.task.answer is not None else None,
            "reward": msg.reward,
            "finish": msg.finish,
            "failure": f"{msg.failure.code}: {msg.failure.message}"
            if msg.HasField("failure") and msg.failure.code
            else None,
            "turns": msg.num_turns,
            "policy_versions": [msg.min_policy_version, msg.max_policy_version],
            "truncated": msg.truncated,
            "latency_s": round(msg.latency_s, 3),
        }
        sample = ev.TrajectorySample(
            trajectory_id=msg.trajectory_id,
            group_id=msg.group_id,
            prompt_id=msg.prompt_id,
            transcript_json=live.transcript.to_json(head),
        )
        with contextlib.suppress(Exception):
            await self.bus.publish(subjects.TRAJ_SAMPLE, sample)

    def _overlong_penalty(self, live: Live) -> float:
        """task.overlong.soft_penalty's share of a trained trajectory's reward (never on a failed one)."""
        penalty = self.task.overlong.soft_penalty
        if penalty is None or live.failure is not None:
            return 0.0
        return overlong_penalty(
            live.traj.output_tokens, self.task.overlong_limit, penalty.length, penalty.factor
        )

    def _count(self, live: Live, fin: Finish, latency: float) -> None:
        traj = live.traj
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
        failure = live.failure.code if live.failure is not None else ""
        rnd.record(fin.reward, traj.versions, failure, traj.trajectory_id)
        if rnd.done:
            assert self.evaluator is not None
            self.evaluator.finish()
            summary = rnd.summary(self.trained_version())
            await durably(self.ledger.eval_done(rnd.version, summary), self.log)
            self.log.info(
                "eval_finished",
                **{k: v for k, v in summary.items() if k != "version"},
                policy_version=rnd.version,
            )
