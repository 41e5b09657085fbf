"""The trainer scores a token under the distribution the engine sampled it from: at top_p < 1,
the nucleus renormalised, exactly as the engine reports it."""

from __future__ import annotations

import torch

from services.generation.sampling import sample_next
from services.learning.grpo import token_logprobs


def test_trainer_and_engine_agree_on_nucleus_logprobs() -> None:
    torch.manual_seed(0)
    b, t, v, temp, top_p = 3, 6, 40, 0.7, 0.9
    logits = torch.randn(b, t, v) * 3
    tokens = torch.zeros(b, t, dtype=torch.long)
    engine_lp = torch.zeros(b, t - 1)
    gen = torch.Generator().manual_seed(1)
    for pos in range(t - 1):  # the engine samples token pos+1 from logits[:, pos]
        tok, lp = sample_next(logits[:, pos], torch.full((b,), temp), gen, torch.full((b,), top_p))
        tokens[:, pos + 1], engine_lp[:, pos] = tok, lp
    trainer_lp = token_logprobs(logits, tokens, temp, top_p)
    assert torch.allclose(trainer_lp, engine_lp, atol=1e-5), (trainer_lp - engine_lp).abs().max()
    full = token_logprobs(logits, tokens, temp)  # the full softmax is below: the nucleus mass < 1
    assert bool((full < trainer_lp - 1e-4).any()) and bool((full <= trainer_lp + 1e-6).all())


def test_a_token_outside_the_nucleus_is_finite_and_gradients_flow() -> None:
    logits = torch.tensor([[[5.0, 4.0, -3.0, -4.0], [0.0, 0.0, 0.0, 0.0]]], requires_grad=True)
    tokens = torch.tensor([[0, 3]])  # token 3 is far outside the top_p 0.9 nucleus of position 0
    lp = token_logprobs(logits, tokens, 1.0, 0.9)
    assert torch.isfinite(lp).all()
    # its normaliser is the nucleus {0, 1} plus itself: exp(-4) / (e^5 + e^4 + e^-4)
    expected = -4.0 - torch.logsumexp(torch.tensor([5.0, 4.0, -4.0]), 0)
    assert abs(float(lp.detach()[0, 0]) - float(expected)) < 1e-5
    lp.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert float(logits.grad[0, 0, 2].abs()) == 0.0  # outside the nucleus and not sampled: no gradient
