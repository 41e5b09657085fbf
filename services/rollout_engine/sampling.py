"""Pure pieces of batched decoding: left padding, temperature sampling with logprobs.

Kept free of models and I/O so the unit tests pin down exactly what the engine reports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (input_ids, attention_mask, position_ids), left-padded so every row ends at the same
    column and positions count real tokens only (a padded row sees exactly what it would alone)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def sample_next(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    generator: torch.Generator | None = None,
    top_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row from softmax(logits / T) and returns (tokens, their logprobs).

    Rows with T <= 0 take the argmax and report log_softmax(logits) of it. With `top_p` (per row,
    in (0, 1]) a row samples from its nucleus — the fewest most likely tokens whose probability
    reaches top_p — renormalised, and reports the logprob under that truncated distribution (the
    true behaviour policy, as vLLM's processed logprobs); at top_p = 1 that is exactly what the
    trainer recomputes from the same weights.
    """
    logits = logits.float()
    greedy = temperatures <= 0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures).float().unsqueeze(-1)
    logp = torch.log_softmax(logits / scale, dim=-1)
    if top_p is not None and bool((top_p < 1.0).any()):
        logp = _nucleus(logp, top_p.float().unsqueeze(-1))
    sampled = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    tokens = torch.where(greedy, logits.argmax(-1), sampled)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _nucleus(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities renormalised over each row's nucleus (-inf outside it). A token is in the
    nucleus when the probability of the tokens more likely than it is still below top_p, so the most
    likely token always is."""
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    before = sorted_logp.exp().cumsum(dim=-1) - sorted_logp.exp()
    outside = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, before >= top_p)
    kept = logp.masked_fill(outside, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


def target_logprobs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """Row-wise log-probabilities of the distribution a token is sampled from (`sample_next`'s):
    softmax(logits / T), renormalised over the nucleus when top_p < 1; greedy (T <= 0) reports
    log_softmax(logits)."""
    logits = logits.float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    if temperature > 0 and top_p < 1.0:
        logp = _nucleus(logp, torch.full((logp.shape[0], 1), float(top_p)))
    return logp


def verify_draft(
    logits: torch.Tensor,
    draft: Sequence[int],
    temperature: float,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> tuple[list[int], list[float]]:
    """Speculative decoding's verification of a deterministic draft, lossless: the emitted tokens
    are distributed exactly as plain sampling from the target would emit them.

    `logits` holds the target model's logits at the k + 1 positions of one verify forward (after
    the context, then after each drafted token); `draft` the k drafted tokens. Drafted token x at
    position j is accepted with probability p_j(x); on rejection one token is drawn from p_j with x
    removed and renormalised, and verification stops; when all k are accepted, one more token is
    drawn from p_k. This is the rejection rule of Leviathan et al. (arXiv 2211.17192, Thm. 1) and
    Chen et al. (arXiv 2302.01318) for a draft distribution that puts all its mass on x: the token
    emitted at j is x with probability p_j(x) and y != x with (1 - p_j(x)) p_j(y) / (1 - p_j(x)).
    Greedy (T <= 0): drafted tokens are kept while they are the argmax, then the argmax is emitted.

    Returns the emitted tokens (the accepted prefix and one more) and their logprobs under p, the
    distribution they were drawn from (what the trainer's importance weights need).
    """
    return verify_drafts(logits, [draft], [temperature], [top_p], generator)[0]


def verify_drafts(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generator: torch.Generator | None = None,
) -> list[tuple[list[int], list[float]]]:
    """`verify_draft` for several rows at once, in two device-to-host copies whatever the number
    of rows and drafted tokens (on a GPU each copy waits for the device, so a row-by-row loop costs
    a wait per drafted token). `logits` packs the rows' k_i + 1 positions one row after another;
    row i's drafted tokens are `drafts[i]`, sampled at `temperatures[i]` and `top_ps[i]`. Every
    drafted token gets its own uniform draw, so each row follows the rule exactly as alone."""
    ks = [len(d) for d in drafts]
    if not len(ks) == len(temperatures) == len(top_ps):
        raise ValueError(f"{len(ks)} drafts need as many temperatures and top_ps")
    if logits.shape[0] != sum(ks) + len(ks):
        raise ValueError(
            f"{sum(ks)} drafted tokens of {len(ks)} rows need {sum(ks) + len(ks)} rows of logits, "
            f"got {logits.shape[0]}"
        )
    if any(not 0 <= x < logits.shape[-1] for d in drafts for x in d):
        raise ValueError(f"a drafted token is outside the vocabulary of {logits.shape[-1]}")
    dev = logits.device
    offsets = [0]
    for k in ks:
        offsets.append(offsets[-1] + k + 1)
    reps = torch.tensor([k + 1 for k in ks], device=dev)
    temp = torch.tensor([float(t) for t in temperatures], device=dev).repeat_interleave(reps)
    scale = torch.where(temp > 0, temp, torch.ones_like(temp)).unsqueeze(-1)
    logp = torch.log_softmax(logits.float() / scale, dim=-1)
    if any(t > 0 and p < 1.0 for t, p in zip(temperatures, top_ps, strict=True)):
        top = torch.tensor([float(p) for p in top_ps], device=dev).repeat_interleave(reps).unsqueeze(-1)
        cut = ((temp > 0) & (top.squeeze(-1) < 1.0)).unsqueeze(-1)
        logp = torch.where(cut, _nucleus(logp, top), logp)
    # 1st copy: each drafted token's logprob, a uniform draw for it, and the argmax at its position
    dpos = [offsets[i] + j for i, k in enumerate(ks) for j in range(k)]
    dtok = [x for d in drafts for x in d]
    n_d = len(dpos)
    if n_d:
        pos_t, tok_t = torch.tensor(dpos, device=dev), torch.tensor(dtok, device=dev)
        u = torch.rand(n_d, generator=generator, device=dev)
        host = torch.cat([logp[pos_t, tok_t], u, logp[pos_t].argmax(-1).float()]).tolist()
    else:
        host = []
    lp_x, draws, best = host[:n_d], host[n_d : 2 * n_d], host[2 * n_d :]
    accepted, finals, rejected_rows, rejected_toks = [], [], [], []
    d_at = 0
    for i, (d, t) in enumerate(zip(drafts, temperatures, strict=True)):
        a = 0
        for j, x in enumerate(d):
            ok = int(best[d_at + j]) == x if t <= 0 else draws[d_at + j] < math.exp(lp_x[d_at + j])
            if not ok:
                rejected_rows.append(i)
                rejected_toks.append(x)
                break
            a += 1
        accepted.append(a)
        finals.append(offsets[i] + a)
        d_at += len(d)
    # 2nd copy: one more token per row, from p at its first rejected position with the rejected
    # token removed (renormalised by the sampler), else from p after the whole draft
    final = logp[torch.tensor(finals, device=dev)]
    probs = final.exp()
    if rejected_rows:
        probs[torch.tensor(rejected_rows, device=dev), torch.tensor(rejected_toks, device=dev)] = 0.0
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    greedy = torch.tensor([t <= 0 for t in temperatures], device=dev)
    tokens = torch.where(greedy, probs.argmax(-1), sampled)
    host2 = torch.cat([tokens.float(), final.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)]).tolist()
    n = len(ks)
    out = []
    d_at = 0
    for i, (d, a) in enumerate(zip(drafts, accepted, strict=True)):
        out.append(([*d[:a], int(host2[i])], [*lp_x[d_at : d_at + a], host2[n + i]]))
        d_at += len(d)
    return out
