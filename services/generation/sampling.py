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
    temperatures: Sequence[float] | torch.Tensor,
    generator: torch.Generator | None = None,
    top_p: Sequence[float] | torch.Tensor | None = None,
    keys: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples one token per row from softmax(logits / T) and returns (tokens, their logprobs).

    Rows with T <= 0 take the argmax and report log_softmax(logits) of it. With `top_p` (per row,
    in (0, 1]) a row samples from its nucleus — the fewest most likely tokens whose probability
    reaches top_p — renormalised, and reports the logprob under that truncated distribution (the
    true behaviour policy, as vLLM's processed logprobs); at top_p = 1 that is exactly what the
    trainer recomputes from the same weights.

    A sampled row's token is the argmax of its logprobs plus Gumbel noise (an exact sample: the
    Gumbel-max trick). The noise is `gumbel_noise(keys)` where keys are given (`noise_key(seed,
    position)`: the same noise whenever that position is sampled again, with or without
    speculation; a rounding difference between two forwards changes the token only where the two
    best noisy scores nearly tie), else drawn from `generator`; greedy rows draw none.

    Temperatures and top_p are best given as host lists: which rows sample, and which cut a
    nucleus, is then known without waiting for the device.
    """
    temps = (
        temperatures.tolist() if isinstance(temperatures, torch.Tensor) else [float(t) for t in temperatures]
    )
    tops = (
        [1.0] * len(temps)
        if top_p is None
        else top_p.tolist()
        if isinstance(top_p, torch.Tensor)
        else [float(p) for p in top_p]
    )
    if not len(temps) == len(tops) == logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows need as many temperatures and top_ps")
    if keys is not None and len(keys) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows need as many noise keys, got {len(keys)}")
    dev = logits.device
    logits = logits.float()
    scale = torch.tensor([t if t > 0 else 1.0 for t in temps], device=dev).unsqueeze(-1)
    logp = torch.log_softmax(logits / scale, dim=-1)
    cut = [t > 0 and p < 1.0 for t, p in zip(temps, tops, strict=True)]
    if any(cut):  # rows at top_p = 1 keep every token, as the trainer does
        inside = _nucleus(logp, torch.tensor(tops, device=dev).unsqueeze(-1))
        logp = torch.where(torch.tensor(cut, device=dev).unsqueeze(-1), inside, logp)
    tokens = logits.argmax(-1)
    hot = [i for i, t in enumerate(temps) if t > 0]
    if hot:
        rows = torch.tensor(hot, device=dev) if len(hot) < len(temps) else None
        scores = (logp if rows is None else logp[rows]).double()
        if keys is None:
            u = torch.rand(scores.shape, generator=generator, device=dev, dtype=torch.float64)
            noise = -torch.log(-torch.log(u.clamp(min=1e-300)))
        else:
            noise = gumbel_noise(torch.tensor([keys[i] for i in hot], device=dev), scores.shape[-1])
        sampled = (scores + noise).argmax(-1)  # -inf outside the nucleus: never
        tokens = sampled if rows is None else tokens.index_copy(0, rows, sampled)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


_MASK32, _MASK64 = (1 << 32) - 1, (1 << 64) - 1


def noise_key(seed: int, position: int) -> int:
    """The 32-bit key of the noise a row samples its token at `position` with: splitmix64's output
    function (Steele et al., OOPSLA 2014) over the seed and the position."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
        x = ((x ^ (x >> shift)) * mult) & _MASK64
    return (x ^ (x >> 31)) >> 32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xor-shift-multiply, constant 0x45d9f3b) of int64 values below 2^32;
    every product stays below 2^59, so nothing overflows."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise for each token of each row, a function of the row's key (below 2^32)
    and the token id only: (rows, vocab) float64."""
    k = keys.to(torch.int64).unsqueeze(-1)
    v = torch.arange(vocab, device=keys.device, dtype=torch.int64).unsqueeze(0)
    x = _mix32(k ^ ((v * 0x61C88647) & _MASK32))
    x = _mix32((x + k) & _MASK32)
    u = (x.double() + 0.5) / float(1 << 32)
    return -torch.log(-torch.log(u))


def _nucleus(logp: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities renormalised over each row's nucleus (-inf outside it). A token is in the
    nucleus when the probability of the tokens more likely than it is still below top_p, so the most
    likely token always is."""
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    before = sorted_logp.exp().cumsum(dim=-1) - sorted_logp.exp()
    outside = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, order, before >= top_p)
    kept = logp.masked_fill(outside, float("-inf"))
    return kept - torch.logsumexp(kept, dim=-1, keepdim=True)


def verify_draft(
    logits: torch.Tensor,
    draft: Sequence[int],
    temperature: float,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    keys: Sequence[int] | None = None,
) -> tuple[list[int], list[float]]:
    """Speculative decoding's verification of a deterministic draft, lossless: the emitted tokens
    are exactly those plain sampling would emit with the same noise.

    `logits` holds the target model's logits at the k + 1 positions of one verify forward (after
    the context, then after each drafted token); `draft` the k drafted tokens. At each position j
    the target's own token is drawn as plain decoding draws it (`sample_next`, with the position's
    noise `keys[j]`; argmax when greedy); drafted token x_j is accepted if it is that token, and
    verification stops at the first that is not, emitting the target's token there. So x_j is
    accepted with probability p_j(x_j), as by the rejection rule of Leviathan et al. (arXiv
    2211.17192, Thm. 1) for a draft that puts all its mass on x_j, and the emitted tokens are
    distributed as p; with noise keyed by position (`noise_key(seed, position)`) they are moreover
    the very tokens decoding without a draft emits.

    Returns the emitted tokens (the accepted prefix and one more) and their logprobs under p, the
    distribution they were drawn from (what the trainer's importance weights need).
    """
    rows = [keys] if keys is not None else None
    return verify_drafts(logits, [draft], [temperature], [top_p], generator, rows)[0]


def verify_drafts(
    logits: torch.Tensor,
    drafts: Sequence[Sequence[int]],
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generator: torch.Generator | None = None,
    keys: Sequence[Sequence[int]] | None = None,
) -> list[tuple[list[int], list[float]]]:
    """`verify_draft` for several rows at once, in one device-to-host copy whatever the number
    of rows and drafted tokens (on a GPU each copy waits for the device, so a row-by-row loop costs
    a wait per drafted token). `logits` packs the rows' k_i + 1 positions one row after another;
    row i's drafted tokens are `drafts[i]`, sampled at `temperatures[i]` and `top_ps[i]` with the
    k_i + 1 noise keys `keys[i]` (else noise drawn from `generator`)."""
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
    if keys is not None and [len(u) for u in keys] != [k + 1 for k in ks]:
        raise ValueError(
            "each row needs one noise key per verified position (its drafted tokens and one more)"
        )
    temp = [float(t) for t, k in zip(temperatures, ks, strict=True) for _ in range(k + 1)]
    top = [float(p) for p, k in zip(top_ps, ks, strict=True) for _ in range(k + 1)]
    flat = [u for row in keys for u in row] if keys is not None else None
    tokens, logps = sample_next(logits, temp, generator, top, flat)
    host = torch.cat([tokens.double(), logps.double()]).tolist()
    n = len(host) // 2
    out = []
    at = 0
    for d in drafts:
        a = 0
        while a < len(d) and int(host[at + a]) == d[a]:
            a += 1
        out.append(([int(t) for t in host[at : at + a + 1]], host[n + at : n + at + a + 1]))
        at += len(d) + 1
    return out
