"""GRPO math: group-normalised advantages and the token-level clipped policy loss.

Contract with the rollout engine: the logprob the engine reports for a sampled token is
`log_softmax(logits / temperature)[token]` at the position that predicted it, with `temperature` the
run's `task.temperature`. `token_logprobs` computes exactly that for the trainer's current weights,
so at step start (same weights, same temperature) the ratio new/old is 1 up to numerics, and the
engine's numbers serve as the old policy without a second forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def group_advantages(rewards: Sequence[float], groups: Sequence[Hashable], eps: float = 1e-6) -> list[float]:
    """(reward - group mean) / (group std + eps) per group; a group of equal rewards carries no signal.

    The std is the population std of the group (divides by n), as the group is the whole sample.
    """
    if len(rewards) != len(groups):
        raise ValueError("rewards and groups must have the same length")
    members: dict[Hashable, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    out = [0.0] * len(rewards)
    for idx in members.values():
        rs = [float(rewards[i]) for i in idx]
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
        for i, r in zip(idx, rs, strict=True):
            out[i] = 0.0 if max(rs) == min(rs) else (r - mean) / (std + eps)
    return out


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logprob of token t+1 under the logits at position t: shape [B, T-1] for inputs of shape [B, T].

    Computed in float32 as a fused cross-entropy, whose backward is markedly cheaper on CPU than
    gather + logsumexp over a 49k vocabulary.
    """
    scaled = logits[:, :-1, :].float()
    if temperature != 1.0:
        scaled = scaled / temperature
    b, t, v = scaled.shape
    nll = F.cross_entropy(scaled.reshape(b * t, v), input_ids[:, 1:].reshape(b * t), reduction="none")
    return -nll.view(b, t)


@dataclass(frozen=True)
class LossMetrics:
    """Token-weighted sums over the masked tokens of one call; divide by `tokens` for means."""

    tokens: float
    clipped: float
    kl: float
    ratio: float

    def __add__(self, other: LossMetrics) -> LossMetrics:
        return LossMetrics(
            self.tokens + other.tokens,
            self.clipped + other.clipped,
            self.kl + other.kl,
            self.ratio + other.ratio,
        )

    def means(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        return {"clip_fraction": self.clipped / n, "kl": self.kl / n, "ratio_mean": self.ratio / n}


def policy_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """PPO-clip loss summed over masked tokens and divided by `num_tokens` (DAPO token-level mean).

    `new_logprobs`, `old_logprobs` and `mask` are [B, L]; `advantages` is [B] (one per sequence).
    Pass the token count of the whole step as `num_tokens` when accumulating gradients over
    micro-batches, so every generated token of the step weighs the same; by default the count of
    this call's masked tokens is used.
    """
    mask = mask.to(new_logprobs.dtype)
    n = float(mask.sum().item()) if num_tokens is None else float(num_tokens)
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    adv = advantages.to(new_logprobs.dtype).unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    loss = (per_token * mask).sum() / max(n, 1.0)
    with torch.no_grad():
        is_clipped = ((ratio < 1.0 - clip_eps) & (adv < 0)) | ((ratio > 1.0 + clip_eps) & (adv > 0))
        k3 = ratio - 1.0 - log_ratio  # KL(old || new) estimated from samples of the old policy
        metrics = LossMetrics(
            tokens=float(mask.sum().item()),
            clipped=float((is_clipped.to(mask.dtype) * mask).sum().item()),
            kl=float((k3 * mask).sum().item()),
            ratio=float((ratio * mask).sum().item()),
        )
    return loss, metrics
