"""What a train step tells the job: its metrics message (`train.metrics`) and its span in each
trained trajectory's own trace."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from services.common.contracts import ev
from services.common.tracing import tracer
from services.trainer.batcher import Pending

if TYPE_CHECKING:
    from services.learning.step import StepStats


def step_metrics(
    stats: StepStats,
    *,
    step: int,
    version: int,
    push: tuple[float, int],
    done: bool,
    groups_ready: int,
    filtered: int,
    sampled: list[float],
    lender: Any,
    lent_turns_answered: int,
) -> ev.TrainMetrics:
    """The step's `TrainMetrics`: `push` is the (seconds, bytes) of its weight push, `sampled`
    the rewards of every trajectory it consumed, `lender` the trainer's lending counts."""
    return ev.TrainMetrics(
        step=step,
        weight_version=version,
        loss=stats.loss,
        reward_mean=stats.reward_mean,
        reward_std=stats.reward_std,
        trajectories=stats.trajectories,
        tokens=stats.tokens,
        step_s=stats.seconds,
        kl=stats.kl,
        clip_fraction=stats.clip_fraction,
        push_s=push[0],
        push_bytes=push[1],
        done=done,
        data_parallel=stats.data_parallel,
        groups_ready=groups_ready,
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
        groups_informative=stats.trained_groups,
        overlong_filtered=stats.overlong_filtered,
        lends=lender.lends,
        reclaims=lender.reclaims,
        early_reclaims=lender.early_reclaims,
        seconds_lent=lender.seconds_lent,
        lent_turns_answered=lent_turns_answered,
    )


def trace_into_trajectories(
    step_span: trace.Span, pendings: list[Pending[Any]], step: int, version: int
) -> None:
    """The step in each trained trajectory's own trace too (a `train.step` child spanning the
    step, linked to the step's span), so one trace shows a trajectory from launch to the step
    that consumed it; the step's span links back to every trajectory."""
    start = getattr(step_span, "start_time", None)
    link = [trace.Link(step_span.get_span_context())]
    attrs = {"libra.train_step": step, "libra.weight_version": version}
    for p in pendings:
        if trace.get_current_span(p.context).get_span_context().is_valid:
            child = tracer().start_span(
                "train.step", context=p.context, links=link, attributes=attrs, start_time=start
            )
            child.end()
