"""One GRPO optimizer step over complete groups: micro-batches, gradient accumulation, grad clipping.

Runs in a worker thread (the event loop keeps renewing the lease meanwhile); `should_abort` is
checked between micro-batches so a shutdown abandons the step before the optimizer touches weights.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.trainer.data import Sample, micro_batches
from services.trainer.data_parallel import all_reduce_gradients, share
from services.trainer.grpo import LossMetrics, group_advantages, policy_loss, token_logprobs


class StepAborted(Exception):
    """The step was abandoned before the optimizer ran; the weights are unchanged."""


@dataclass(frozen=True)
class StepStats:
    loss: float
    tokens: int
    trajectories: int
    reward_mean: float
    reward_std: float
    kl: float
    clip_fraction: float
    ratio_mean: float
    grad_norm: float
    seconds: float
    data_parallel: int = 1
    """Replicas that computed the step (1 + hybrid workers)."""


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    samples: Sequence[Sample],
    *,
    temperature: float,
    clip_eps: float,
    micro_batch: int,
    pad_id: int,
    max_grad_norm: float = 1.0,
    should_abort: Callable[[], bool] = lambda: False,
    dp_group: Any = None,
) -> StepStats:
    """With `dp_group` (a torch.distributed group whose rank 0 is the trainer), this replica
    computes its share of the micro-batches and the gradients are summed over the group
    (`data_parallel`); only rank 0 clips and steps. Every replica must call it with the same
    samples. Stats are the whole step's on every replica. A replica (rank > 0) needs no optimizer."""
    start = time.perf_counter()
    rewards = [s.reward for s in samples]
    advantages = group_advantages(rewards, [s.group_id for s in samples])
    batches = micro_batches(samples, advantages, micro_batch, pad_id)
    total_tokens = sum(mb.num_tokens for mb in batches)
    rank, world = 0, 1
    if dp_group is not None:
        rank, world = dp_group.rank(), dp_group.size()
    if rank == 0 and optimizer is None:
        raise ValueError("the replica that steps (rank 0) needs the optimizer")
    model.train()
    model.zero_grad(set_to_none=True)
    loss_sum = 0.0
    metrics = LossMetrics(0.0, 0.0, 0.0, 0.0)
    for mb in share(batches, rank, world):
        if should_abort():
            model.zero_grad(set_to_none=True)
            raise StepAborted()
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
        new_lp = token_logprobs(logits, mb.input_ids, temperature)
        loss, m = policy_loss(new_lp, mb.old_logprobs, mb.advantages, mb.loss_mask, clip_eps, total_tokens)
        loss.backward()
        loss_sum += float(loss.item())
        metrics = metrics + m
        del logits, new_lp, loss
    if should_abort():
        model.zero_grad(set_to_none=True)
        raise StepAborted()
    if dp_group is not None:
        all_reduce_gradients(model, dp_group)
        loss_sum, metrics = _sum_stats(loss_sum, metrics, dp_group)
    params: list[Any] = [p for p in model.parameters() if p.grad is not None]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm)) if params else 0.0
    if rank == 0 and optimizer is not None:
        optimizer.step()
    model.zero_grad(set_to_none=True)
    means = metrics.means()
    return StepStats(
        loss=loss_sum,
        tokens=total_tokens,
        trajectories=len(samples),
        reward_mean=statistics.fmean(rewards),
        reward_std=statistics.pstdev(rewards),
        kl=means["kl"],
        clip_fraction=means["clip_fraction"],
        ratio_mean=means["ratio_mean"],
        grad_norm=grad_norm,
        seconds=time.perf_counter() - start,
    )


def _sum_stats(loss_sum: float, m: LossMetrics, group: Any) -> tuple[float, LossMetrics]:
    import torch.distributed as dist

    t = torch.tensor([loss_sum, m.tokens, m.clipped, m.kl, m.ratio], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    v = t.tolist()
    return v[0], LossMetrics(v[1], v[2], v[3], v[4])
