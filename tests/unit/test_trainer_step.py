"""A GRPO step on a real (tiny, random) model: each token scored at the temperature that sampled it,
the engine-vs-trainer mismatch measured on the tokens of the step's own weights, zero-advantage
groups filtered before collation, the scheduled learning rate applied, several updates per step."""

from __future__ import annotations

import math

import pytest
import torch

from services.common.runconfig import LearnJob, ModelConfig
from services.learning.data import Sample
from services.learning.grpo import LossConfig
from services.learning.step import StepAborted, StepSettings, sample_advantages, train_step


@pytest.fixture
def model(tiny_model: ModelConfig) -> torch.nn.Module:
    from services.common.models import load_model

    torch.manual_seed(0)
    return load_model(tiny_model)


def engine_sample(
    model: torch.nn.Module,
    tid: str,
    group: str,
    reward: float,
    *,
    temperature: float,
    claimed: float | None = None,
    version: int = 0,
    seed: int = 0,
) -> Sample:
    """A trajectory as an engine would send it: 4 prompt tokens, 6 tokens sampled at `temperature`
    by `model` with their logprobs at that temperature; the segment names `claimed` (default: the
    true one) as its temperature."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 400, (4,), generator=g).tolist()
    lps: list[float] = []
    with torch.no_grad():
        for _ in range(6):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits / temperature, dim=-1)
            tok = int(torch.multinomial(logp.exp(), 1, generator=g))
            ids.append(tok)
            lps.append(float(logp[tok]))
    t = temperature if claimed is None else claimed
    mask, behaviour = [False] * 4 + [True] * 6, [0.0] * 4 + lps
    return Sample(tid, group, reward, ids, mask, behaviour, [1.0] * 4 + [t] * 6, [-1] * 4 + [version] * 6)


def settings(**kw) -> StepSettings:
    return StepSettings(LossConfig(), micro_batch=2, pad_id=0, **kw)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_tokens_are_scored_at_their_own_temperature(model: torch.nn.Module) -> None:
    samples = [
        engine_sample(model, "a", "g", 1.0, temperature=0.5, seed=1),
        engine_sample(model, "b", "g", 0.0, temperature=1.3, seed=2),
    ]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = train_step(model, opt, samples, settings())
    assert stats.mismatch_tokens == 12
    assert stats.logprob_mismatch < 1e-5
    assert stats.is_weight_mean == pytest.approx(1.0, abs=1e-4)
    assert stats.kl == pytest.approx(0.0, abs=1e-6)
    # the same tokens scored at the config's temperature instead of the sampler's
    wrong = [
        engine_sample(model, "a", "g", 1.0, temperature=0.5, claimed=1.0, seed=1),
        engine_sample(model, "b", "g", 0.0, temperature=1.3, claimed=1.0, seed=2),
    ]
    assert train_step(model, opt, wrong, settings()).logprob_mismatch > 1e-2


def test_stale_tokens_are_corrected_not_counted_as_mismatch(model: torch.nn.Module) -> None:
    fresh = engine_sample(model, "a", "g", 1.0, temperature=1.0, version=3, seed=1)
    old = engine_sample(model, "b", "g", 0.0, temperature=1.0, version=2, seed=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = train_step(model, opt, [fresh, old], settings(version=3))
    assert stats.mismatch_tokens == 6
    assert stats.policy_versions == (2, 3)
    assert stats.stale_token_fraction == pytest.approx(0.5)


def test_zero_advantage_groups_are_not_collated(model: torch.nn.Module) -> None:
    mixed = [engine_sample(model, f"m{i}", "mixed", float(i), temperature=1.0, seed=i) for i in range(2)]
    flat = [engine_sample(model, f"f{i}", "flat", 1.0, temperature=1.0, seed=10 + i) for i in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = train_step(model, opt, mixed + flat, settings())
    assert (stats.tokens, stats.trained_groups, stats.updates, stats.trajectories) == (12, 1, 1, 4)
    assert stats.reward_mean == pytest.approx(0.75)  # over every trajectory of the step
    before = weights(model)
    stats = train_step(model, opt, flat, settings())
    assert (stats.tokens, stats.updates, stats.loss) == (0, 0, 0.0)
    assert math.isnan(stats.entropy) and math.isnan(stats.logprob_mismatch)  # nothing measured
    after = weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before), "no update without an advantage"


def test_a_trajectory_of_two_sequences_is_one_member_of_its_group(model: torch.nn.Module) -> None:
    """An agent that rewrote its conversation sent two sequences: both carry the trajectory's
    advantage, and the group's baseline and the step's counts take the trajectory once."""
    a1, a2 = (engine_sample(model, "a", "g", 1.0, temperature=1.0, seed=i) for i in range(2))
    b, c = (engine_sample(model, t, "g", 0.0, temperature=1.0, seed=2 + i) for i, t in enumerate("bc"))
    assert sample_advantages([a1, a2, b, c], "dr_grpo") == pytest.approx([2 / 3, 2 / 3, -1 / 3, -1 / 3])
    stats = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [a1, a2, b, c], settings())
    assert (stats.trajectories, stats.tokens, stats.trained_groups) == (3, 24, 1)
    assert stats.reward_mean == pytest.approx(1 / 3)


def test_the_scheduled_lr_is_applied_and_each_mini_batch_updates(model: torch.nn.Module) -> None:
    samples = [
        engine_sample(model, f"t{i}", f"g{i // 2}", float(i % 2), temperature=1.0, seed=i) for i in range(6)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    stats = train_step(model, opt, samples, settings(lr=3e-4, mini_batches=3))
    assert stats.updates == 3 and stats.trained_groups == 3
    assert opt.param_groups[0]["lr"] == 3e-4 and stats.lr == 3e-4
    # after the first update the policy moved from the proximal one: its ratio is no longer 1
    assert stats.ratio_mean != pytest.approx(1.0, abs=1e-7)
    assert stats.mismatch_tokens == 36  # measured against the step-start weights throughout


def test_an_abort_before_the_first_update_leaves_the_weights(model: torch.nn.Module) -> None:
    samples = [engine_sample(model, f"t{i}", "g", float(i), temperature=1.0, seed=i) for i in range(2)]
    before = weights(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(StepAborted):
        train_step(model, opt, samples, settings(), should_abort=lambda: True)
    after = weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_plain_grpo_trains_zero_advantage_groups_too(model: torch.nn.Module) -> None:
    """With dynamic sampling off every sample is collated: its tokens count in the token mean."""
    mixed = [engine_sample(model, f"m{i}", "mixed", float(i), temperature=1.0, seed=i) for i in range(2)]
    flat = [engine_sample(model, f"f{i}", "flat", 1.0, temperature=1.0, seed=10 + i) for i in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = train_step(model, opt, mixed + flat, settings(drop_zero_advantage=False))
    assert (stats.tokens, stats.trained_groups, stats.updates) == (24, 1, 1)
    assert train_step(model, opt, flat, settings(drop_zero_advantage=False)).updates == 1


def test_bf16_autocast_trains_fp32_master_weights_close_to_fp32(model: torch.nn.Module) -> None:
    """training.precision bf16 (here under the CPU's autocast; CUDA's on a GPU node): the forward
    runs in bfloat16, the weights and their update stay float32, and the step's statistics agree
    with fp32's to bf16 precision."""
    samples = [
        engine_sample(model, "a", "g", 1.0, temperature=1.0, seed=1),
        engine_sample(model, "b", "g", 0.0, temperature=1.0, seed=2),
    ]
    start = weights(model)
    runs = {}
    for bf16 in (False, True):
        model.load_state_dict(start)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        stats = train_step(model, opt, samples, settings(bf16=bf16, device="cpu"))
        runs[bf16] = (stats, weights(model))
    (fp32, w32), (bf, wbf) = runs[False], runs[True]
    assert all(v.dtype == torch.float32 for v in wbf.values())
    assert any(not torch.equal(wbf[k], start[k]) for k in start)  # it trained
    assert bf.logprob_mismatch > fp32.logprob_mismatch  # bf16 rounding shows against fp32 sampling...
    assert bf.logprob_mismatch < 0.1  # ...but stays small
    assert bf.loss == pytest.approx(fp32.loss, abs=0.05)
    # AdamW moves each weight by about lr (1e-3); bf16 and fp32 updates differ by less than twice that
    assert max(float((wbf[k] - w32[k]).abs().max()) for k in start) <= 2e-3 + 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_step_on_cuda_matches_the_cpu(model: torch.nn.Module) -> None:
    samples = [
        engine_sample(model, "a", "g", 1.0, temperature=1.0, seed=1),
        engine_sample(model, "b", "g", 0.0, temperature=1.0, seed=2),
    ]
    start = weights(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cpu = train_step(model, opt, samples, settings(device="cpu"))
    model.load_state_dict(start)
    model.cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gpu = train_step(model, opt, samples, settings(device="cuda", bf16=True))
    assert gpu.loss == pytest.approx(cpu.loss, abs=0.05) and gpu.tokens == cpu.tokens
    assert all(p.dtype == torch.float32 and p.is_cuda for p in model.parameters())


def test_the_kl_reference_is_the_configured_model(
    model: torch.nn.Module, tiny_model: ModelConfig, tmp_path
) -> None:
    """training.reference_model replaces the initial policy as the KL's reference; a reference with
    another vocabulary is refused before anything loads."""
    import transformers

    from services.common.config import ConfigFileError
    from services.common.runconfig import RunConfig
    from services.learning.recipe import reference_for

    base = {"model": tiny_model.model_dump(), "training": {"kl_coef": 0.1}}
    cpu = torch.device("cpu")
    initial = reference_for(LearnJob.of(RunConfig.model_validate(base)), cpu)
    other = tiny_model.model_copy(update={"seed": 1})
    base["training"]["reference_model"] = other.model_dump()
    configured = reference_for(LearnJob.of(RunConfig.model_validate(base)), cpu)
    assert initial is not None and configured is not None
    emb = lambda m: m.get_input_embeddings().weight  # noqa: E731
    assert torch.equal(emb(initial), emb(model)) and not torch.equal(emb(configured), emb(model))
    samples = [engine_sample(model, f"t{i}", "g", float(i % 2), temperature=1.0, seed=i) for i in range(2)]
    kls, frozen = [], torch.optim.SGD(model.parameters(), lr=0.0)
    for ref in (initial, configured):
        stats = train_step(
            model,
            frozen,
            samples,
            StepSettings(LossConfig(kl_coef=0.1), micro_batch=2, pad_id=0),
            ref_model=ref,
        )
        kls.append(stats.ref_kl)
    assert (
        kls[0] == pytest.approx(0.0, abs=1e-6) and kls[1] > 1e-3
    )  # the step scored against the weights it was given

    small = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    transformers.LlamaForCausalLM(small).save_pretrained(tmp_path / "small")
    base["training"]["reference_model"] = {"source": "path", "path": str(tmp_path / "small")}
    with pytest.raises(ConfigFileError) as err:
        reference_for(LearnJob.of(RunConfig.model_validate(base)), cpu)
    assert "vocabulary of 100 tokens" in err.value.message


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"])
def test_every_loss_aggregation_is_the_same_whatever_the_micro_batch(
    model: torch.nn.Module, agg: str
) -> None:
    """Gradients accumulated over micro-batches of 1 equal one pass over the whole mini-batch:
    each micro-batch divides by the mini-batch's token or sequence count."""
    samples = [engine_sample(model, f"t{i}", "g", float(i % 2), temperature=1.0, seed=i) for i in range(3)]
    samples.append(engine_sample(model, "short", "g", 1.0, temperature=1.0, seed=9))
    samples[-1].loss_mask[-3:] = [False] * 3  # a shorter answer: the modes differ

    def grads(micro: int) -> tuple[float, list[torch.Tensor]]:
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        captured: list[torch.Tensor] = []

        def keep() -> None:
            captured.extend(p.grad.detach().clone() for p in model.parameters() if p.grad is not None)

        opt.step = keep  # type: ignore[method-assign]  # the gradients before zero_grad
        s = StepSettings(LossConfig(loss_agg=agg), micro_batch=micro, pad_id=0)
        return train_step(model, opt, samples, s).loss, captured

    loss_one, g_one = grads(1)
    loss_all, g_all = grads(4)
    assert loss_one == pytest.approx(loss_all, rel=1e-5, abs=1e-7)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(g_one, g_all, strict=True))


def test_the_overlong_filter_drops_truncated_tokens_but_keeps_their_rewards_in_the_baseline(
    model: torch.nn.Module,
) -> None:
    """Group rewards 1, 0, 0 with the first 0 truncated: its 6 tokens leave the loss, and the other
    two keep the advantages of the whole group (so the step equals one where its loss mask was
    cleared by hand)."""
    import dataclasses

    samples = [
        engine_sample(model, f"t{i}", "g", r, temperature=1.0, seed=i) for i, r in enumerate([1.0, 0.0, 0.0])
    ]
    samples[1] = dataclasses.replace(samples[1], truncated=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    on = train_step(model, opt, samples, settings(overlong_filter=True))
    assert (on.tokens, on.overlong_filtered, on.trajectories, on.trained_groups) == (12, 1, 3, 1)
    by_hand = [samples[0], dataclasses.replace(samples[1], loss_mask=[False] * 10), samples[2]]
    manual = train_step(model, opt, by_hand, settings())
    assert on.loss == pytest.approx(manual.loss, rel=1e-6)
    off = train_step(model, opt, samples, settings())
    assert (off.tokens, off.overlong_filtered) == (18, 0)  # off: trained like any other
