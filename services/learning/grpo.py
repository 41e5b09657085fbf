"""GRPO math: the off-policy-correct token-level policy loss (advantages: `advantages.py`).

Three policies meet in an asynchronous step (AReaL's decoupled PPO, Fu et al. 2025, §5):

- the **behaviour** policy sampled the tokens on an engine, up to `max_staleness` versions ago; its
  logprobs travel with each segment, with the temperature they were computed at;
- the **proximal** policy is the trainer's weights when the step starts, scored by the trainer itself
  at each segment's temperature (`token_logprobs`): the PPO trust region is taken around it;
- the **current** policy is the one being optimised.

Per generated token with advantage A, ratio r = pi/pi_prox and importance weight
w = min(pi_prox/pi_behaviour, tis_cap) (truncated importance sampling, Ionides 2008; verl's TIS):

    loss = w * max(-A r, -A clip(r, 1 - eps, 1 + eps_high))        (A >= 0)
    loss = w * min(max(-A r, -A clip(r, 1 - eps, 1 + eps_high)), -A c)   (A < 0, dual-clip c)

plus `kl_coef` times the k3 estimate of KL(pi || pi_ref) to a frozen reference when configured,
aggregated over the (mini-)batch by `loss_agg`: `token_mean`, summed over its generated tokens and
divided by their count (DAPO's token-level mean: every token weighs the same); or
`seq_mean_token_sum`, each sequence's tokens summed and the sums averaged over its sequences (a
long sequence weighs more, no length normalisation: Dr. GRPO's aggregation up to a constant); or
`seq_mean_token_mean`, each sequence's token mean averaged over its sequences (the original GRPO:
every sequence weighs the same, so a long one's tokens weigh less).

`rollout_correction` chooses w (rho_t = pi_prox/pi_behaviour at token t, cap = `tis_cap`):
`tis` w_t = min(rho_t, cap) (above); `mis`, masked IS, w_t = rho_t inside [1/cap, cap] and 0
outside (a token the sampler and the trainer disagree on that much is left out, not down-weighted:
IcePop's two-sided mask); `seq_is`, one weight per sequence, w = min(prod_t rho_t, cap) on all of
its tokens (sequence-level truncated IS: unbiased for the sequence's likelihood ratio up to the
truncation, with more variance).
The dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"; verl `clip_ratio_c`)
bounds the loss of a negative-advantage token whose ratio has grown large. `w` carries no gradient;
it corrects for the tokens' sampler being older than (or numerically different from) the trainer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CHUNK_BYTES = 64 * 2**20
"""The float32 working set of one chunk of positions when scoring tokens: a micro-batch's logits
are [B, T, V], and scoring them whole made several float32 copies of that size (scaled, softmax,
their gradients; with top_p the sort's too): 2-4 GB for 4 x 640 tokens of a 49k vocabulary, tens
of GB for a 16k-token micro-batch of a 152k one. In chunks only one chunk's copies are alive."""


def _chunks(logits: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """(row, start, logits) of positions start..start+n-1 of each row, together positions 0..T-2,
    each at most CHUNK_BYTES of float32. Views cut by `unbind` and `split`, whose backward passes
    put the chunks' gradients together with one allocation (a slice's allocates its whole input)."""
    b, t, v = logits.shape
    step = max(1, CHUNK_BYTES // (4 * v))
    out = []
    for i, row in enumerate(logits.unbind(0)):
        for k, piece in enumerate(row.split(step)):
            start = k * step
            n = min(piece.shape[0], t - 1 - start)
            if n > 0:
                out.append((i, start, piece if n == piece.shape[0] else piece[:n]))
    return out


def _scored(rows: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """Rows of logits / temperature in float32; a tensor temperature is one per row."""
    scaled = rows.float()
    if isinstance(temperature, torch.Tensor):
        return scaled / temperature.to(scaled.dtype).unsqueeze(-1)
    return scaled / temperature if temperature != 1.0 else scaled


def _rows_logprobs(
    rows: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor, kept: torch.Tensor | None
) -> torch.Tensor:
    """Logprob of each target under softmax(row / T), renormalised over `kept` (the nucleus, with
    the target in it) where given."""
    scaled = _scored(rows, temperature)
    nll = F.cross_entropy(scaled, targets, reduction="none")
    if kept is None:
        return -nll
    full = torch.logsumexp(scaled, dim=-1)
    truncated = torch.logsumexp(scaled.masked_fill(~kept, float("-inf")), dim=-1)
    return -nll + full - truncated


@torch.no_grad()
def _nucleus_of(
    rows: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor, top_p: float
) -> torch.Tensor | None:
    """The rows' nucleus with each target added (None at top_p 1): computed once, outside the
    checkpoint (a bool per logit, a quarter of a float32 copy), not sorted again in the backward."""
    if top_p >= 1.0:
        return None
    kept = nucleus_mask(_scored(rows, temperature), top_p)
    return kept.scatter_(-1, targets.unsqueeze(-1), True)


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float | torch.Tensor, top_p: float = 1.0
) -> torch.Tensor:
    """Logprob of token t+1 under softmax(logits[t] / T): shape [B, T-1] for inputs of shape [B, T].

    `temperature` is one number or a [B, T-1] tensor (each position scored at the temperature its
    token was sampled at). Computed in float32 as a fused cross-entropy, whose backward is markedly
    cheaper on CPU than gather + logsumexp over a 49k vocabulary. With `top_p` < 1 the distribution
    is the one the engines sample from: renormalised over the nucleus (the fewest most likely tokens
    whose probability reaches top_p, as services/generation/sampling.py cuts it), so the trainer
    and the engine score a token alike; a token outside this policy's nucleus (the policy moved
    since it was sampled) is scored as if the nucleus held it too, never -inf.

    Scored in chunks of positions (`CHUNK_BYTES`); with gradients on, each chunk is checkpointed
    (its float32 copies are computed again in the backward pass instead of kept), so the memory
    beyond the logits and their gradient is one chunk's, whatever the micro-batch.
    """
    from torch.utils.checkpoint import checkpoint

    grad = torch.is_grad_enabled() and logits.requires_grad
    parts = []
    for i, s, rows in _chunks(logits):
        e = s + rows.shape[0]
        temp = temperature[i, s:e] if isinstance(temperature, torch.Tensor) else temperature
        targets = input_ids[i, s + 1 : e + 1]
        args = (rows, targets, temp, _nucleus_of(rows.detach(), targets, temp, top_p))
        parts.append(
            checkpoint(_rows_logprobs, *args, use_reentrant=False) if grad else _rows_logprobs(*args)
        )
    b, t, _ = logits.shape
    return torch.cat(parts).view(b, t - 1) if parts else logits.new_zeros(b, 0, dtype=torch.float32)


@torch.no_grad()
def nucleus_mask(scaled_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """True for each row's nucleus: a token is in it when the probability of the tokens more
    likely than it is still below top_p (so the most likely token always is)."""
    probs = torch.softmax(scaled_logits.float(), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    return torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < top_p)


@torch.no_grad()
def entropy_sum(logits: torch.Tensor, temperature: float | torch.Tensor, mask: torch.Tensor) -> float:
    """Sum over the masked positions ([B, T-1]) of the entropy of softmax(logits / T), in nats.
    Only the masked rows of one chunk at a time are materialised (a [B, T, V] copy is hundreds of MB)."""
    keep = mask.bool()
    total = 0.0
    for i, s, rows in _chunks(logits.detach()):
        sel = keep[i, s : s + rows.shape[0]]
        if not bool(sel.any()):
            continue
        temp = (
            temperature[i, s : s + rows.shape[0]][sel]
            if isinstance(temperature, torch.Tensor)
            else temperature
        )
        logp = torch.log_softmax(_scored(rows[sel], temp), dim=-1)
        total += float(-(logp.exp() * logp).sum().item())
    return total


@dataclass(frozen=True)
class LossConfig:
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    """Upper clip bound 1 + clip_eps_high (DAPO's clip-higher); None: clip_eps."""
    dual_clip: float | None = 3.0
    """Bound c > 1 on a negative-advantage token's loss (-A c); None disables."""
    tis_cap: float = 2.0
    """Truncation of the importance weight pi_prox / pi_behaviour."""
    kl_coef: float = 0.0
    """Weight of the k3 KL to the frozen reference (0: no reference)."""
    loss_agg: str = "token_mean"
    """token_mean | seq_mean_token_sum | seq_mean_token_mean (module docstring)."""
    rollout_correction: str = "tis"
    """tis | mis | seq_is: how pi_prox/pi_behaviour weighs the tokens (module docstring)."""


LOSS_AGGS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
ROLLOUT_CORRECTIONS = ("tis", "mis", "seq_is")


@dataclass(frozen=True)
class LossMetrics:
    """Sums over the masked tokens of one call (maxima for `is_weight_max`); `means` divides."""

    tokens: float = 0.0
    clipped: float = 0.0
    dual_clipped: float = 0.0
    ratio: float = 0.0
    is_weight: float = 0.0
    is_weight_max: float = 0.0
    truncated: float = 0.0
    behaviour_kl: float = 0.0
    ref_kl: float = 0.0
    entropy: float = 0.0
    mismatch: float = 0.0
    mismatch_tokens: float = 0.0

    MAXED = ("is_weight_max",)

    def __add__(self, other: LossMetrics) -> LossMetrics:
        return LossMetrics(
            **{
                f.name: (max if f.name in self.MAXED else _add)(getattr(self, f.name), getattr(other, f.name))
                for f in dataclasses.fields(self)
            }
        )

    def values(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in dataclasses.fields(self)]

    @classmethod
    def of(cls, values: Sequence[float]) -> LossMetrics:
        return cls(*values)

    def means(self) -> dict[str, float]:
        n = max(self.tokens, 1.0)
        return {
            "clip_fraction": self.clipped / n,
            "dual_clip_fraction": self.dual_clipped / n,
            "ratio_mean": self.ratio / n if self.tokens else 1.0,
            "is_weight_mean": self.is_weight / n if self.tokens else 1.0,
            "is_weight_max": self.is_weight_max,
            "is_truncated_fraction": self.truncated / n,
            "kl": self.behaviour_kl / n,
            "ref_kl": self.ref_kl / n,
            "entropy": self.entropy / n if self.tokens else math.nan,
            "logprob_mismatch": self.mismatch / self.mismatch_tokens if self.mismatch_tokens else math.nan,
        }


def _add(a: float, b: float) -> float:
    return a + b


def policy_loss(
    new_logprobs: torch.Tensor,
    prox_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    num_tokens: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    same_weights: torch.Tensor | None = None,
    num_seqs: float | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """The decoupled, truncated-IS, dual-clipped loss of the module docstring.

    `new_logprobs` (with gradient), `prox_logprobs`, `behaviour_logprobs`, `mask` and the optional
    `ref_logprobs` are [B, L]; `advantages` is [B] (one per sequence). Pass the token count of
    the whole (mini-)batch as `num_tokens` when accumulating gradients over micro-batches, so every
    generated token weighs the same; by default this call's masked tokens are counted.
    `same_weights` marks the tokens the engine sampled with the weights `prox_logprobs` come from:
    on those, |prox - behaviour| is the engine-vs-trainer logprob mismatch. `num_seqs` is the
    (mini-)batch's sequence count for the `seq_mean_*` aggregations (default: this call's).
    """
    mask = mask.to(new_logprobs.dtype)
    n = float(mask.sum().item()) if num_tokens is None else float(num_tokens)
    seqs = float((mask.sum(-1) > 0).sum().item()) if num_seqs is None else float(num_seqs)
    prox = prox_logprobs.detach()
    log_ratio = new_logprobs - prox
    ratio = torch.exp(log_ratio)
    adv = advantages.to(new_logprobs.dtype).unsqueeze(-1)
    high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - cfg.clip_eps, 1.0 + high)
    clipped_loss = torch.maximum(pg1, pg2)
    per_token = clipped_loss
    dual = torch.zeros_like(mask, dtype=torch.bool)
    if cfg.dual_clip is not None:
        bound = -adv * cfg.dual_clip
        dual = (adv < 0) & (bound < clipped_loss)
        per_token = torch.where(adv < 0, torch.minimum(clipped_loss, bound), clipped_loss)
    with torch.no_grad():
        raw_weight, weight, corrected = importance_weights(prox, behaviour_logprobs, mask, cfg)
    per_token = per_token * weight
    ref_k3 = None
    if ref_logprobs is not None and cfg.kl_coef > 0:
        d = ref_logprobs.detach() - new_logprobs
        ref_k3 = torch.exp(d) - d - 1.0  # k3 estimate of KL(pi || pi_ref), samples of pi (Schulman 2020)
        per_token = per_token + cfg.kl_coef * ref_k3
    loss = aggregate(per_token, mask, cfg.loss_agg, n, seqs)
    with torch.no_grad():
        m = mask

        def total(x: torch.Tensor) -> float:
            return float((x.to(m.dtype) * m).sum().item())

        rho = torch.exp(prox - behaviour_logprobs)
        behaviour_k3 = (
            rho - 1.0 - (prox - behaviour_logprobs)
        )  # KL(behaviour || prox) from behaviour's samples
        live = m.bool()
        if same_weights is not None:
            on = live & same_weights.bool()
            mismatch = float((prox - behaviour_logprobs).abs()[on].sum().item())
            mismatch_tokens = float(on.sum().item())
        else:
            mismatch, mismatch_tokens = 0.0, 0.0
        metrics = LossMetrics(
            tokens=float(m.sum().item()),
            clipped=total(pg2 > pg1),
            dual_clipped=total(dual),
            ratio=total(ratio),
            is_weight=total(weight),
            is_weight_max=float(raw_weight[live].max().item()) if bool(live.any()) else 0.0,
            truncated=total(corrected),
            behaviour_kl=total(behaviour_k3),
            ref_kl=total(ref_k3) if ref_k3 is not None else 0.0,
            mismatch=mismatch,
            mismatch_tokens=mismatch_tokens,
        )
    return loss, metrics


def importance_weights(
    prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token ([B, L]): rho = pi_prox/pi_behaviour, the weight `rollout_correction` gives the
    token's loss, and where the correction changed rho (truncated or masked)."""
    log_rho = (prox - behaviour) * mask
    rho = torch.exp(log_rho)
    cap = cfg.tis_cap
    if cfg.rollout_correction == "tis":
        return rho, torch.clamp(rho, max=cap), rho > cap
    if cfg.rollout_correction == "mis":
        outside = (rho > cap) | (rho < 1.0 / cap)
        return rho, torch.where(outside, torch.zeros_like(rho), rho), outside
    if cfg.rollout_correction == "seq_is":
        seq_rho = torch.exp(log_rho.sum(-1, keepdim=True)).expand_as(rho)
        return rho, torch.clamp(seq_rho, max=cap), (seq_rho > cap) & mask.bool()
    raise ValueError(
        f"rollout_correction {cfg.rollout_correction!r}: one of {', '.join(ROLLOUT_CORRECTIONS)}"
    )


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, how: str, tokens: float, seqs: float
) -> torch.Tensor:
    """The loss of a (mini-)batch of `tokens` generated tokens in `seqs` sequences from its
    per-token losses ([B, L]) under `loss_agg` (module docstring); a micro-batch's share of it."""
    masked = per_token * mask
    if how == "token_mean":
        return masked.sum() / max(tokens, 1.0)
    if how == "seq_mean_token_sum":
        return masked.sum() / max(seqs, 1.0)
    if how == "seq_mean_token_mean":
        lengths = mask.sum(-1).clamp(min=1.0)
        return (masked.sum(-1) / lengths).sum() / max(seqs, 1.0)
    raise ValueError(f"loss_agg {how!r}: one of {', '.join(LOSS_AGGS)}")
