"""GRPO math: advantages, the clipped token-level loss, and that a step moves the policy the right way."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer.data import Sample, collate
from services.trainer.grpo import group_advantages, policy_loss, token_logprobs


def test_advantages_are_normalised_per_group() -> None:
    adv = group_advantages([1.0, 0.0, 1.0, 0.0, 5.0, 3.0], ["a", "a", "a", "a", "b", "b"])
    a, b = adv[:4], adv[4:]
    assert sum(a) == pytest.approx(0.0, abs=1e-9)
    assert math.sqrt(sum(x * x for x in a) / 4) == pytest.approx(1.0, rel=1e-5)
    assert b == pytest.approx([1.0, -1.0], rel=1e-5)


def test_equal_rewards_give_zero_advantage() -> None:
    assert group_advantages([0.7, 0.7, 0.7], ["g", "g", "g"]) == [0.0, 0.0, 0.0]


def test_advantage_sign_follows_reward() -> None:
    adv = group_advantages([0.2, 0.9, 0.5], ["g"] * 3)
    assert adv[1] > 0 > adv[0]
    assert adv[0] < adv[2] < adv[1]


def test_ratio_one_gives_minus_mean_advantage_over_tokens() -> None:
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, -4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0])
    loss, m = policy_loss(lp, lp.clone(), adv, mask, clip_eps=0.2)
    # three tokens: two with advantage 2, one with -1
    assert loss.item() == pytest.approx(-(2.0 + 2.0 - 1.0) / 3)
    assert m.tokens == 3
    assert m.means()["clip_fraction"] == 0.0
    assert m.means()["kl"] == pytest.approx(0.0, abs=1e-7)
    assert m.means()["ratio_mean"] == pytest.approx(1.0)


def test_clipping_caps_the_objective_beyond_eps() -> None:
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(new, old, torch.tensor([1.0]), mask, clip_eps=0.2)
    # token 0: ratio 1.5 > 1.2 with A>0 -> clipped to 1.2 (no gradient); token 1: min(0.5, 0.8) = 0.5
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    loss.backward()
    assert new.grad is not None
    assert new.grad[0, 0].item() == 0.0
    assert new.grad[0, 1].item() != 0.0
    assert m.means()["clip_fraction"] == pytest.approx(0.5)
    assert m.means()["kl"] > 0.0


def test_num_tokens_sets_the_denominator_for_accumulation() -> None:
    lp = torch.zeros(1, 4)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, _ = policy_loss(lp, lp, torch.tensor([1.0]), mask, clip_eps=0.2, num_tokens=8)
    assert loss.item() == pytest.approx(-0.5)


def test_token_logprobs_match_log_softmax_with_temperature() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    out = token_logprobs(logits, ids, temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, dim=-1)
    assert out.shape == (2, 4)
    assert torch.allclose(out[1, 2], ref[1, 2, ids[1, 3]])


def test_a_step_raises_the_logprob_of_a_positive_advantage_sequence(tiny_model) -> None:
    from services.common.models import load_model

    torch.manual_seed(0)
    model = load_model(tiny_model)
    prompt, completion = [1, 42, 77, 300], [512, 9, 1024, 7, 256]
    sample = Sample("t", "g", 1.0, prompt + completion, [False] * 4 + [True] * 5, [0.0] * 9)

    def logprob() -> tuple[torch.Tensor, torch.Tensor]:
        mb = collate([sample], [1.0], pad_id=0)
        lp = token_logprobs(model(input_ids=mb.input_ids).logits, mb.input_ids, 1.0)
        return lp, mb

    with torch.no_grad():
        before, mb = logprob()
    old = before.detach()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    new, _ = logprob()
    loss, _ = policy_loss(new, old, torch.tensor([1.0]), mb.loss_mask, clip_eps=0.2)
    loss.backward()
    opt.step()
    with torch.no_grad():
        after, _ = logprob()
    gen = mb.loss_mask[0]
    assert after[0][gen].sum().item() > before[0][gen].sum().item()
