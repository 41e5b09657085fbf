"""One GRPO step over complete groups: zero-advantage filtering, mini-batches of whole groups,
micro-batches with gradient accumulation, grad clipping, the learning-rate schedule.

Runs in a worker thread (the event loop keeps renewing the lease meanwhile); `should_abort` is
checked between micro-batches until the first optimizer update, so a shutdown abandons the step
before the optimizer touches the weights (after that the step runs to its end: a half-applied step
would leave the weights in memory matching no checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.learning.advantages import group_advantages, informative
from services.learning.data import MicroBatch, Sample, micro_batches, one_per_trajectory
from services.learning.data_parallel import all_reduce_gradients, share
from services.learning.grpo import LossConfig, LossMetrics, entropy_sum, policy_loss, token_logprobs


class StepAborted(Exception):
    """The step was abandoned before the optimizer ran; the weights are unchanged."""


@dataclass(frozen=True)
class StepSettings:
    """What every rank of a step must agree on (the trainer and its hybrid replicas build it from
    the same run config and the version the trainer sends with the samples)."""

    loss: LossConfig
    micro_batch: int
    pad_id: int
    mini_batches: int = 1
    max_grad_norm: float = 1.0
    lr: float | None = None
    """Set on the optimizer before every update (rank 0); None leaves it as it is."""
    version: int = 0
    """The weights the step starts from: tokens they sampled measure the engine-vs-trainer mismatch."""
    drop_zero_advantage: bool = True
    """Leave groups of equal rewards out of the step (DAPO's dynamic sampling; they add no policy
    gradient and would dilute the token mean); False trains every sample as plain GRPO does."""
    device: str = "cpu"
    """Where the model is: micro-batches are moved there."""
    bf16: bool = False
    """Forward and backward under bfloat16 autocast (the weights stay in their own dtype)."""
    top_p: float = 1.0
    """The nucleus the engines sampled from (task.top_p): tokens are scored under it."""
    advantage: str = "grpo"
    """The group advantage estimator (training.advantage; services/learning/advantages.py)."""
    overlong_filter: bool = False
    """task.overlong.filter: a truncated sample's tokens leave the loss (its reward still counts
    in its group's advantages)."""
    sharded: bool = False
    """FSDP (services/learning/fsdp.py): every rank holds a shard and steps its optimizer, gradients
    are reduce-scattered by the backward pass itself, every rank runs as many passes, and the step
    cannot be abandoned half-way (the ranks' collectives must match)."""


@dataclass(frozen=True)
class StepStats:
    loss: float
    tokens: int
    """Generated tokens the step trained on (zero-advantage groups filtered out)."""
    trajectories: int
    reward_mean: float
    reward_std: float
    kl: float
    """k3 KL(behaviour || proximal) on the sampled tokens: how off-policy the batch was."""
    clip_fraction: float
    ratio_mean: float
    grad_norm: float
    seconds: float
    data_parallel: int = 1
    """Replicas that computed the step (1 + hybrid workers)."""
    entropy: float = math.nan
    """Mean per-token entropy of the trained tokens (NaN when the step trained none)."""
    is_weight_mean: float = 1.0
    is_weight_max: float = 0.0
    is_truncated_fraction: float = 0.0
    dual_clip_fraction: float = 0.0
    logprob_mismatch: float = math.nan
    mismatch_tokens: int = 0
    ref_kl: float = 0.0
    lr: float = 0.0
    updates: int = 0
    """Optimizer updates applied (0 when no group of the step had an advantage)."""
    trained_groups: int = 0
    """Groups with a non-zero advantage."""
    policy_versions: tuple[int, ...] = ()
    stale_token_fraction: float = 0.0
    overlong_filtered: int = 0
    """Truncated samples whose tokens the overlong filter left out."""


def lr_at(step: int, *, lr: float, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """Learning rate of the update at 0-based `step` of `total`: linear warm-up over `warmup`
    steps to `lr`, then constant, or decaying (linear, cosine) to lr × min_ratio at the last step."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    span = max(1, total - warmup - 1)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    if schedule == "linear":
        factor = 1.0 - progress
    elif schedule == "cosine":
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown lr schedule {schedule!r}")
    return lr * (min_ratio + (1.0 - min_ratio) * factor)


def split_groups(samples: Sequence[Sample], parts: int) -> list[list[Sample]]:
    """Whole groups in the order they came, dealt into at most `parts` contiguous mini-batches."""
    order: dict[str, list[Sample]] = {}
    for s in samples:
        order.setdefault(s.group_id, []).append(s)
    groups = list(order.values())
    parts = max(1, min(parts, len(groups)))
    out: list[list[Sample]] = []
    for k in range(parts):
        chunk = groups[k * len(groups) // parts : (k + 1) * len(groups) // parts]
        out.append([s for g in chunk for s in g])
    return out


def sample_advantages(samples: Sequence[Sample], estimator: str) -> list[float]:
    """Each sample's advantage: its trajectory's within its group, every trajectory counted once
    however many sequences it was trained as."""
    members = one_per_trajectory(samples)
    adv = group_advantages([t.reward for t in members], [t.group_id for t in members], estimator=estimator)
    of = {t.trajectory_id: a for t, a in zip(members, adv, strict=True)}
    return [of[s.trajectory_id] for s in samples]


def _version_stats(samples: Sequence[Sample], version: int) -> tuple[tuple[int, ...], float]:
    seen: set[int] = set()
    stale = total = 0
    for s in samples:
        for v, m in zip(s.versions or [-1] * len(s.loss_mask), s.loss_mask, strict=True):
            if m:
                seen.add(v)
                total += 1
                stale += v < version
    return tuple(sorted(seen)), stale / total if total else 0.0


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    samples: Sequence[Sample],
    settings: StepSettings,
    *,
    should_abort: Callable[[], bool] = lambda: False,
    dp_group: Any = None,
    ref_model: torch.nn.Module | None = None,
) -> StepStats:
    """With `dp_group` (a torch.distributed group whose rank 0 is the trainer), this replica
    computes its share of the micro-batches and the gradients are summed over the group
    (`data_parallel`); only rank 0 steps, and between two updates of one step it sends the
    replicas its weights. Every replica must call it with the same samples and settings. Stats
    are the whole step's on every replica. A replica (rank > 0) needs no optimizer."""
    start = time.perf_counter()
    rank, world = (dp_group.rank(), dp_group.size()) if dp_group is not None else (0, 1)
    sharded = settings.sharded and dp_group is not None
    if (rank == 0 or sharded) and optimizer is None:
        raise ValueError("the replica that steps (rank 0, or every FSDP rank) needs the optimizer")
    if sharded:
        should_abort = _never
    members = one_per_trajectory(samples)
    rewards = [s.reward for s in members]
    by_group: dict[str, list[float]] = {}
    for s in members:
        by_group.setdefault(s.group_id, []).append(s.reward)
    kept = [s for s in samples if informative(by_group[s.group_id]) or not settings.drop_zero_advantage]
    cut = [s for s in kept if s.truncated] if settings.overlong_filter else []
    if cut:  # DAPO's overlong filtering: no tokens to learn from, still in its group's baseline
        kept = [
            dataclasses.replace(s, loss_mask=[False] * len(s.loss_mask)) if s.truncated else s for s in kept
        ]
    versions, stale_fraction = _version_stats(kept, settings.version)
    minis = [
        [
            mb.to(settings.device)
            for mb in micro_batches(
                m,
                sample_advantages(m, settings.advantage),
                settings.micro_batch,
                settings.pad_id,
            )
        ]
        for m in (split_groups(kept, settings.mini_batches) if kept else [])
    ]
    model.train()
    model.zero_grad(set_to_none=True)
    prox = _proximal(model, minis, rank, world, should_abort, settings) if len(minis) > 1 else {}
    loss_sum, metrics, norms, lr = 0.0, LossMetrics(), [], 0.0
    for k, mbs in enumerate(minis):
        tokens = sum(mb.num_tokens for mb in mbs)
        seqs = sum(mb.num_sequences for mb in mbs)
        abortable = k == 0
        for mb, weight in _passes(mbs, rank, world, sharded):
            if abortable and should_abort():
                model.zero_grad(set_to_none=True)
                raise StepAborted()
            # FSDP averages the gradients over its ranks; each rank's loss is its share of a sum
            scale = weight * world if sharded else weight
            loss, m = _micro_step(model, mb, prox.get(id(mb)), settings, (tokens, seqs), ref_model, scale)
            if weight:
                loss_sum += loss / len(minis)
                metrics = metrics + m
        if abortable and should_abort():
            model.zero_grad(set_to_none=True)
            raise StepAborted()
        if dp_group is not None and not sharded:
            all_reduce_gradients(model, dp_group)
        params: list[Any] = [p for p in model.parameters() if p.grad is not None]
        norms.append(_clip(params, settings.max_grad_norm) if params else 0.0)
        if (rank == 0 or sharded) and optimizer is not None:
            if settings.lr is not None:
                for g in optimizer.param_groups:
                    g["lr"] = settings.lr
            lr = float(optimizer.param_groups[0]["lr"])
            optimizer.step()
        model.zero_grad(set_to_none=True)
        if dp_group is not None and not sharded and k < len(minis) - 1:
            from services.learning.hybrid import broadcast_weights

            broadcast_weights(dp_group, model)  # the replicas' next mini-batch is on the new weights
    if dp_group is not None:
        loss_sum, metrics = _sum_stats(loss_sum, metrics, dp_group)
    means = metrics.means()
    return StepStats(
        loss=loss_sum,
        tokens=int(metrics.tokens),
        trajectories=len(members),
        reward_mean=statistics.fmean(rewards) if rewards else 0.0,
        reward_std=statistics.pstdev(rewards) if rewards else 0.0,
        kl=means["kl"],
        clip_fraction=means["clip_fraction"],
        ratio_mean=means["ratio_mean"],
        grad_norm=statistics.fmean(norms) if norms else 0.0,
        seconds=time.perf_counter() - start,
        entropy=means["entropy"],
        is_weight_mean=means["is_weight_mean"],
        is_weight_max=means["is_weight_max"],
        is_truncated_fraction=means["is_truncated_fraction"],
        dual_clip_fraction=means["dual_clip_fraction"],
        logprob_mismatch=means["logprob_mismatch"],
        mismatch_tokens=int(metrics.mismatch_tokens),
        ref_kl=means["ref_kl"],
        lr=lr if settings.lr is None else settings.lr,
        updates=len(minis),
        trained_groups=len({s.group_id for s in kept if informative(by_group[s.group_id])}),
        policy_versions=versions,
        stale_token_fraction=stale_fraction,
        overlong_filtered=len(cut),
    )


def _never() -> bool:
    return False


def _passes(mbs: list[MicroBatch], rank: int, world: int, sharded: bool) -> list[tuple[MicroBatch, float]]:
    """This rank's micro-batches with their weight (1). Sharded, every rank runs as many passes as
    the busiest: a rank with fewer pads with weight-0 passes over the first micro-batch."""
    mine = [(mb, 1.0) for mb in share(mbs, rank, world)]
    if sharded:
        mine += [(mbs[0], 0.0)] * (-(-len(mbs) // world) - len(mine))
    return mine


def _clip(params: list[Any], max_norm: float) -> float:
    """Clips to the global norm and returns it (under FSDP the norm is a DTensor over the shards)."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def _forward_logprobs(
    model: torch.nn.Module, mb: MicroBatch, settings: StepSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (in the autocast dtype under bf16) and the float32 logprobs of the sampled tokens."""
    device_type = torch.device(settings.device).type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=settings.bf16):
        # no KV cache: nothing is generated (and with checkpointed activations HF would refuse it)
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    return logits, token_logprobs(logits, mb.input_ids, mb.temperatures, settings.top_p)


@torch.no_grad()
def _proximal(
    model: torch.nn.Module,
    minis: list[list[MicroBatch]],
    rank: int,
    world: int,
    should_abort: Callable[[], bool],
    settings: StepSettings,
) -> dict[int, torch.Tensor]:
    """The step-start policy's logprobs of this rank's micro-batches, before any update."""
    out = {}
    for mbs in minis:
        for mb, weight in _passes(mbs, rank, world, settings.sharded):
            if should_abort():
                raise StepAborted()
            lp = _forward_logprobs(model, mb, settings)[1].detach()
            if weight:
                out[id(mb)] = lp
    return out


def _micro_step(
    model: torch.nn.Module,
    mb: MicroBatch,
    prox: torch.Tensor | None,
    settings: StepSettings,
    sizes: tuple[int, int],
    ref_model: torch.nn.Module | None,
    scale: float = 1.0,
) -> tuple[float, LossMetrics]:
    """Forward and backward of one micro-batch (its gradient times `scale`) of a mini-batch of
    `sizes` (generated tokens, sequences); returns its loss and metric sums."""
    logits, new_lp = _forward_logprobs(model, mb, settings)
    ref_lp = None
    if ref_model is not None and settings.loss.kl_coef > 0:
        with torch.no_grad():
            ref_lp = _forward_logprobs(ref_model, mb, settings)[1]
    loss, m = policy_loss(
        new_lp,
        new_lp.detach() if prox is None else prox,
        mb.behaviour_logprobs,
        mb.advantages,
        mb.loss_mask,
        settings.loss,
        sizes[0],
        ref_lp,
        same_weights=mb.versions == settings.version,
        num_seqs=sizes[1],
    )
    m = dataclasses.replace(m, entropy=entropy_sum(logits, mb.temperatures, mb.loss_mask))
    (loss * scale if scale != 1.0 else loss).backward()
    return float(loss.item()), m


def _sum_stats(loss_sum: float, m: LossMetrics, group: Any) -> tuple[float, LossMetrics]:
    import torch.distributed as dist

    values = m.values()
    t = torch.tensor([loss_sum, *values], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    names = [f.name for f in dataclasses.fields(m)]
    top = torch.tensor([values[names.index(n)] for n in LossMetrics.MAXED], dtype=torch.float64)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    summed = t.tolist()
    out = summed[1:]
    for n, v in zip(LossMetrics.MAXED, top.tolist(), strict=True):
        out[names.index(n)] = v
    return summed[0], LossMetrics.of(out)
