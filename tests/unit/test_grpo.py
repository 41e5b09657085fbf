"""GRPO math against hand-computed values: advantages, the decoupled PPO loss with truncated
importance sampling and dual-clip, the KL to a reference, entropy, temperatures, the LR schedule,
and that a step moves the policy the right way."""

from __future__ import annotations

import math

import pytest
import torch

from services.learning.advantages import group_advantages, informative
from services.learning.data import Sample, collate
from services.learning.grpo import LossConfig, entropy_sum, policy_loss, token_logprobs
from services.learning.step import lr_at, split_groups

PPO = LossConfig(clip_eps=0.2, dual_clip=None, tis_cap=2.0)


def loss_of(new, prox, behaviour, adv, cfg=PPO, **kw):
    mask = torch.ones_like(new, dtype=torch.bool)
    return policy_loss(new, prox, behaviour, torch.tensor(adv), mask, cfg, **kw)


def test_advantages_are_normalised_per_group() -> None:
    adv = group_advantages([1.0, 0.0, 1.0, 0.0, 5.0, 3.0], ["a", "a", "a", "a", "b", "b"])
    a, b = adv[:4], adv[4:]
    assert sum(a) == pytest.approx(0.0, abs=1e-9)
    assert math.sqrt(sum(x * x for x in a) / 4) == pytest.approx(1.0, rel=1e-5)
    assert b == pytest.approx([1.0, -1.0], rel=1e-5)


def test_equal_rewards_give_zero_advantage_and_are_not_informative() -> None:
    assert group_advantages([0.7, 0.7, 0.7], ["g", "g", "g"]) == [0.0, 0.0, 0.0]
    assert not informative([0.7, 0.7, 0.7]) and not informative([])
    assert informative([0.7, 0.7, 0.8])


def test_advantage_sign_follows_reward() -> None:
    adv = group_advantages([0.2, 0.9, 0.5], ["g"] * 3)
    assert adv[1] > 0 > adv[0]
    assert adv[0] < adv[2] < adv[1]


def test_on_policy_ratio_one_gives_minus_mean_advantage_over_tokens() -> None:
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, -4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    loss, m = policy_loss(lp, lp.clone(), lp.clone(), torch.tensor([2.0, -1.0]), mask, PPO)
    # three tokens: two with advantage 2, one with -1
    assert loss.item() == pytest.approx(-(2.0 + 2.0 - 1.0) / 3)
    means = m.means()
    assert m.tokens == 3
    assert means["clip_fraction"] == 0.0 and means["is_truncated_fraction"] == 0.0
    assert means["kl"] == pytest.approx(0.0, abs=1e-7)
    assert means["ratio_mean"] == pytest.approx(1.0) and means["is_weight_mean"] == pytest.approx(1.0)


def test_clipping_caps_the_objective_beyond_eps() -> None:
    zero = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()
    loss, m = loss_of(new, zero, zero, [1.0])
    # token 0: ratio 1.5 > 1.2 with A>0 -> clipped to 1.2 (no gradient); token 1: min(0.5, 0.8) = 0.5
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    loss.backward()
    assert new.grad is not None
    assert new.grad[0, 0].item() == 0.0
    assert new.grad[0, 1].item() == pytest.approx(-0.5 / 2)  # d(-r/2)/dlog r = -r/2
    assert m.means()["clip_fraction"] == pytest.approx(0.5)


def test_clip_higher_widens_only_the_upper_bound() -> None:
    zero = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]]))
    cfg = LossConfig(clip_eps=0.2, clip_eps_high=0.28, dual_clip=None)
    loss, _ = loss_of(new, zero, zero, [1.0], cfg)
    assert loss.item() == pytest.approx(-(1.28 + 0.5) / 2)
    loss, _ = loss_of(new, zero, zero, [-1.0], cfg)  # A<0: ratio 0.5 clipped up to 0.8, 1.5 kept
    assert loss.item() == pytest.approx((1.5 + 0.8) / 2)


def test_dual_clip_bounds_a_negative_advantage_token_with_a_large_ratio() -> None:
    zero = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[4.0, 2.0, 0.5]])).requires_grad_()
    cfg = LossConfig(clip_eps=0.2, dual_clip=3.0)
    loss, m = loss_of(new, zero, zero, [-1.0], cfg)
    # A = -1: max(r, clip(r)) = 4, 2, 0.8; the dual clip bounds the first at c|A| = 3
    assert loss.item() == pytest.approx((3.0 + 2.0 + 0.8) / 3)
    loss.backward()
    assert new.grad is not None
    assert new.grad[0].tolist() == pytest.approx([0.0, 2.0 / 3, 0.0])
    assert m.means()["dual_clip_fraction"] == pytest.approx(1 / 3)
    # unbounded without it
    loss, _ = loss_of(new.detach(), zero, zero, [-1.0], PPO)
    assert loss.item() == pytest.approx((4.0 + 2.0 + 0.8) / 3)
    # positive advantages are never dual-clipped
    loss, m = loss_of(new.detach(), zero, zero, [1.0], cfg)
    assert loss.item() == pytest.approx(-(1.2 + 1.2 + 0.5) / 3) and m.dual_clipped == 0


def test_truncated_importance_weight_scales_each_token_and_carries_no_gradient() -> None:
    prox = torch.log(torch.tensor([[0.6, 0.1]]))
    behaviour = torch.log(torch.tensor([[0.2, 0.2]]))  # weights pi_prox/pi_behaviour = 3 and 0.5
    new = prox.clone().requires_grad_()
    loss, m = loss_of(new, prox, behaviour, [1.0], LossConfig(tis_cap=2.0))
    # ratio 1 on both; weights truncated to 2 and 0.5
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    loss.backward()
    assert new.grad is not None
    assert new.grad[0].tolist() == pytest.approx([-2.0 / 2, -0.5 / 2])
    means = m.means()
    assert means["is_weight_mean"] == pytest.approx(1.25)
    assert means["is_weight_max"] == pytest.approx(3.0)
    assert means["is_truncated_fraction"] == pytest.approx(0.5)
    # k3 KL(behaviour || prox): rho - 1 - log rho, rho = 3 and 0.5
    assert means["kl"] == pytest.approx(((3 - 1 - math.log(3)) + (0.5 - 1 - math.log(0.5))) / 2, rel=1e-5)


def test_kl_to_the_reference_adds_the_k3_estimate() -> None:
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    new = ref + math.log(2.0)  # pi = 2 pi_ref: d = log(pi_ref/pi) = -log 2 on both tokens
    cfg = LossConfig(kl_coef=0.1)
    loss, m = loss_of(new, new, new, [0.0], cfg, ref_logprobs=ref)
    k3 = 0.5 + math.log(2.0) - 1.0
    assert loss.item() == pytest.approx(0.1 * k3, rel=1e-5)
    assert m.means()["ref_kl"] == pytest.approx(k3, rel=1e-5)
    loss, m = loss_of(new, new, new, [0.0], LossConfig(kl_coef=0.0), ref_logprobs=ref)
    assert loss.item() == 0.0 and m.ref_kl == 0.0


def test_mismatch_counts_only_tokens_sampled_by_the_proximal_weights() -> None:
    prox = torch.tensor([[-1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.001, -0.997, -3.0]])
    same = torch.tensor([[True, True, False]])  # the third token is from older weights
    _, m = loss_of(prox, prox, behaviour, [1.0], same_weights=same)
    assert m.mismatch_tokens == 2
    assert m.means()["logprob_mismatch"] == pytest.approx(0.002, rel=1e-3)
    _, m = loss_of(prox, prox, behaviour, [1.0])
    assert math.isnan(m.means()["logprob_mismatch"])


def test_num_tokens_sets_the_denominator_for_accumulation() -> None:
    lp = torch.zeros(1, 4)
    loss, _ = loss_of(lp, lp, lp, [1.0], num_tokens=8)
    assert loss.item() == pytest.approx(-0.5)


def test_token_logprobs_use_each_positions_temperature() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    ids = torch.randint(0, 11, (2, 5))
    out = token_logprobs(logits, ids, temperature=0.7)
    assert out.shape == (2, 4)
    assert torch.allclose(out[1, 2], torch.log_softmax(logits / 0.7, dim=-1)[1, 2, ids[1, 3]])
    temps = torch.tensor([[1.0, 0.5, 0.5, 2.0], [0.7, 0.7, 1.3, 1.3]])
    out = token_logprobs(logits, ids, temps)
    for b in range(2):
        for t in range(4):
            want = torch.log_softmax(logits[b, t] / temps[b, t], dim=-1)[ids[b, t + 1]]
            assert out[b, t].item() == pytest.approx(want.item(), abs=1e-6)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_tokens_scored_in_chunks_match_the_whole_logits_and_their_gradients(
    top_p: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chunks of 3 positions (a row of 7 cut 3 + 3 + 1, its last position predicting nothing): the
    logprobs, their gradient with respect to the logits, and the entropy are those of the whole
    [B, T, V] scored at once."""
    from services.learning import grpo

    torch.manual_seed(1)
    b, t, v = 2, 8, 13
    logits = torch.randn(b, t, v, dtype=torch.float64).float()
    ids = torch.randint(0, v, (b, t))
    temps = torch.rand(b, t - 1) + 0.5
    mask = torch.rand(b, t - 1) > 0.3

    def whole(x: torch.Tensor) -> torch.Tensor:
        scaled = x[:, :-1] / temps.unsqueeze(-1)
        logp = torch.log_softmax(scaled, dim=-1)
        if top_p < 1.0:
            kept = grpo.nucleus_mask(scaled.detach(), top_p).scatter(-1, ids[:, 1:].unsqueeze(-1), True)
            logp = torch.log_softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
        return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)

    weights = torch.randn(b, t - 1)
    ref_in = logits.clone().requires_grad_(True)
    ref = whole(ref_in)
    (ref * weights).sum().backward()
    monkeypatch.setattr(grpo, "CHUNK_BYTES", 3 * 4 * v)
    got_in = logits.clone().requires_grad_(True)
    got = grpo.token_logprobs(got_in, ids, temps, top_p)
    (got * weights).sum().backward()
    assert got.shape == (b, t - 1)
    assert torch.allclose(got, ref, atol=1e-5)
    assert got_in.grad is not None and ref_in.grad is not None
    assert torch.allclose(got_in.grad, ref_in.grad, atol=1e-5)
    assert torch.all(got_in.grad[:, -1] == 0)  # the last position predicts no token
    logp = torch.log_softmax(logits[:, :-1] / temps.unsqueeze(-1), dim=-1)
    want = float(-(logp.exp() * logp).sum(-1)[mask].sum())
    assert grpo.entropy_sum(logits, temps, mask) == pytest.approx(want, rel=1e-5)
    assert grpo.token_logprobs(logits[:, :1], ids[:, :1], 1.0, top_p).shape == (b, 0)  # nothing to score


def test_entropy_of_uniform_and_of_peaked_distributions() -> None:
    logits = torch.zeros(1, 3, 8)
    logits[0, 1, 0] = 100.0
    mask = torch.tensor([[True, True]])
    # position 0 uniform over 8 -> log 8; position 1 one-hot -> 0
    assert entropy_sum(logits, 1.0, mask) == pytest.approx(math.log(8), rel=1e-5)
    assert entropy_sum(logits, torch.ones(1, 2), torch.tensor([[False, True]])) == pytest.approx(
        0.0, abs=1e-5
    )
    # a high temperature flattens the peak
    assert entropy_sum(logits, torch.full((1, 2), 1e4), torch.tensor([[False, True]])) > 2.0


def test_lr_schedule_warms_up_then_decays_to_the_floor() -> None:
    kw = {"lr": 1.0, "warmup": 2, "total": 6, "min_ratio": 0.1}
    assert [lr_at(s, schedule="constant", **kw) for s in range(6)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    lin = [lr_at(s, schedule="linear", **kw) for s in range(6)]
    assert lin == pytest.approx([0.5, 1.0, 1.0, 0.7, 0.4, 0.1])
    cos = [lr_at(s, schedule="cosine", **kw) for s in range(6)]
    assert cos[2] == pytest.approx(1.0) and cos[5] == pytest.approx(0.1)
    assert cos[3] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 3)))
    assert lr_at(0, lr=0.3, schedule="cosine", warmup=0, total=1, min_ratio=0.0) == pytest.approx(0.3)


def test_mini_batches_hold_whole_groups_in_order() -> None:
    samples = [Sample(f"t{i}", f"g{i // 2}", 0.0, [1, 2], [False, True], [0.0, -1.0]) for i in range(6)]
    parts = split_groups(samples, 2)
    assert [[s.group_id for s in p] for p in parts] == [["g0", "g0"], ["g1", "g1", "g2", "g2"]]
    assert len(split_groups(samples, 10)) == 3


def test_a_step_raises_the_logprob_of_a_positive_advantage_sequence(tiny_model) -> None:
    from services.common.models import load_model

    torch.manual_seed(0)
    model = load_model(tiny_model)
    prompt, completion = [1, 42, 77, 300], [512, 9, 1024, 7, 256]
    sample = Sample("t", "g", 1.0, prompt + completion, [False] * 4 + [True] * 5, [0.0] * 9)

    def logprob() -> tuple[torch.Tensor, torch.Tensor]:
        mb = collate([sample], [1.0], pad_id=0)
        lp = token_logprobs(model(input_ids=mb.input_ids).logits, mb.input_ids, mb.temperatures)
        return lp, mb

    with torch.no_grad():
        before, mb = logprob()
    old = before.detach()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    new, _ = logprob()
    loss, _ = policy_loss(new, old, old, torch.tensor([1.0]), mb.loss_mask, LossConfig())
    loss.backward()
    opt.step()
    with torch.no_grad():
        after, _ = logprob()
    gen = mb.loss_mask[0]
    assert after[0][gen].sum().item() > before[0][gen].sum().item()


def test_advantage_estimators_by_hand() -> None:
    """Group a: rewards 1, 0, 0, 0 (mean 0.25, population std sqrt(3)/4); group b: 2, 2 (no signal)."""
    rewards, groups = [1.0, 0.0, 0.0, 0.0, 2.0, 2.0], ["a", "a", "a", "a", "b", "b"]
    std = math.sqrt(3) / 4
    grpo = group_advantages(rewards, groups, eps=0.0)
    assert grpo == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std, 0.0, 0.0])
    dr = group_advantages(rewards, groups, estimator="dr_grpo")
    assert dr == pytest.approx([0.75, -0.25, -0.25, -0.25, 0.0, 0.0])
    # rloo: 1 - mean(0, 0, 0) = 1; 0 - mean(1, 0, 0) = -1/3
    rloo = group_advantages(rewards, groups, estimator="rloo")
    assert rloo == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3, 0.0, 0.0])
    assert group_advantages([1.0], ["solo"], estimator="rloo") == [0.0]
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(rewards, groups, estimator="ppo")


def test_the_config_offers_exactly_the_estimators_the_trainer_has() -> None:
    import typing

    from services.common.runconfig import TrainingConfig
    from services.learning.advantages import ESTIMATORS

    assert typing.get_args(TrainingConfig.model_fields["advantage"].annotation) == ESTIMATORS


def test_the_run_config_chooses_the_estimator_and_the_nucleus_of_every_step() -> None:
    from services.common.runconfig import LearnJob, RunConfig
    from services.learning.recipe import step_settings

    run = RunConfig.model_validate({"training": {"advantage": "rloo"}, "task": {"top_p": 0.9}})
    settings = step_settings(LearnJob.of(run), pad_id=0, version=0)
    assert (settings.advantage, settings.top_p) == ("rloo", 0.9)


def test_loss_aggregation_modes_against_hand_computed_values() -> None:
    """On-policy (ratio 1, weight 1): each token's loss is -A. Two sequences, advantages 2 and
    -1, with 3 and 1 generated tokens: per-token losses -2, -2, -2 | 1."""
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.1, -4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0])

    def loss(agg: str, **kw) -> float:
        cfg = LossConfig(clip_eps=0.2, dual_clip=None, loss_agg=agg)
        return policy_loss(lp, lp.clone(), lp.clone(), adv, mask, cfg, **kw)[0].item()

    assert loss("token_mean") == pytest.approx((-6.0 + 1.0) / 4)  # every token the same
    assert loss("seq_mean_token_sum") == pytest.approx((-6.0 + 1.0) / 2)  # sums, averaged
    assert loss("seq_mean_token_mean") == pytest.approx((-2.0 + 1.0) / 2)  # means, averaged
    # a micro-batch of a larger mini-batch divides by the mini-batch's counts
    assert loss("seq_mean_token_sum", num_seqs=5) == pytest.approx(-5.0 / 5)
    assert loss("seq_mean_token_mean", num_seqs=4) == pytest.approx(-1.0 / 4)
    with pytest.raises(ValueError, match="loss_agg"):
        loss("sum")


def test_rollout_correction_modes_against_hand_computed_weights() -> None:
    """prox - behaviour = log rho per token: rho = 3, 1/3, 1.5 on sequence one (rho product 1.5),
    rho = 2.5 on sequence two; cap 2. On-policy ratio, advantage 1: a token's loss is -w."""
    prox = torch.zeros(2, 3)
    behaviour = -torch.log(torch.tensor([[3.0, 1 / 3, 1.5], [2.5, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0])

    def run(mode: str) -> tuple[float, dict[str, float]]:
        cfg = LossConfig(clip_eps=0.2, dual_clip=None, tis_cap=2.0, rollout_correction=mode)
        loss, m = policy_loss(prox.clone(), prox, behaviour, adv, mask, cfg)
        return loss.item(), m.means()

    loss, means = run("tis")  # min(rho, 2): 2, 1/3, 1.5 | 2
    assert loss == pytest.approx(-(2 + 1 / 3 + 1.5 + 2) / 4)
    assert means["is_truncated_fraction"] == pytest.approx(2 / 4)
    loss, means = run("mis")  # rho inside [1/2, 2], else 0: 0, 0, 1.5 | 0
    assert loss == pytest.approx(-1.5 / 4)
    assert means["is_truncated_fraction"] == pytest.approx(3 / 4)
    loss, means = run("seq_is")  # min(prod rho, 2) per sequence: 1.5 x3 | 2
    assert loss == pytest.approx(-(1.5 * 3 + 2) / 4)
    assert means["is_truncated_fraction"] == pytest.approx(1 / 4)  # sequence two's one token
    with pytest.raises(ValueError, match="rollout_correction"):
        run("ppo")


def test_the_config_offers_exactly_the_loss_options_the_trainer_has() -> None:
    import typing

    from services.common.runconfig import LearnJob, RunConfig, TrainingConfig
    from services.learning.grpo import LOSS_AGGS, ROLLOUT_CORRECTIONS
    from services.learning.recipe import step_settings

    fields = TrainingConfig.model_fields
    assert typing.get_args(fields["loss_agg"].annotation) == LOSS_AGGS
    assert typing.get_args(fields["rollout_correction"].annotation) == ROLLOUT_CORRECTIONS
    run = RunConfig.model_validate(
        {"training": {"loss_agg": "seq_mean_token_sum", "rollout_correction": "mis"}}
    )
    loss = step_settings(LearnJob.of(run), pad_id=0, version=0).loss
    assert (loss.loss_agg, loss.rollout_correction) == ("seq_mean_token_sum", "mis")
