"""Pure pieces of batched decoding: left padding, temperature sampling with logprobs.

Kept free of models and I/O so the unit tests pin down exactly what the engine reports.
"""

from __future__ import annotations

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
