"""LoRA (training.lora) for real, with peft on the tiny model: only the adapters train; what leaves
the trainer (a weight push, a checkpoint's export) is the merged model under the plain model's
names, which a plain engine model scores exactly as the trainer does; the export loads with
transformers, and its adapter with peft on the base model gives the same logits; a resumed trainer
holds the same policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.models import load_model
from services.common.runconfig import LearnJob, ModelConfig, RunConfig
from services.learning.grpo import token_logprobs
from services.learning.learner import Learner
from tests.learning_samples import random_groups
from tools.export import export_policy

pytestmark = pytest.mark.integration


def _run(model: ModelConfig) -> RunConfig:
    training = {"lora": {"rank": 4, "alpha": 8}, "lr": 1e-2, "micro_batch": 2, "torch_threads": 1}
    return RunConfig.model_validate({"model": model.model_dump(), "training": training})


def _logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return token_logprobs(model(input_ids=ids).logits, ids, 1.0)


def test_a_lora_trainer_trains_adapters_and_sends_the_merged_model(
    tiny_model: ModelConfig, tmp_path: Path
) -> None:
    learner = Learner(LearnJob.of(_run(tiny_model)), tmp_path / "ckpt")
    base = {k: v.detach().clone() for k, v in load_model(tiny_model).state_dict().items()}
    trainable = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert {id(p) for g in learner.optimizer.param_groups for p in g["params"]} == {
        id(p) for p in learner.model.parameters() if p.requires_grad
    }
    # untrained (B = 0): the merged model is the base model
    snap = learner.snapshot()
    assert set(snap.names) <= set(base) and "model.embed_tokens.weight" in snap.names
    for name, tensor, shape in zip(snap.names, snap.tensors, snap.shapes, strict=True):
        assert torch.equal(tensor.view(shape), base[name]), name

    stats = learner.step(random_groups(1))
    assert stats.trained_groups == 2 and stats.tokens > 0
    learner.commit({"s1"})
    merged = learner._plain_state()
    moved = [n for n in merged if not torch.equal(merged[n], base[n])]
    assert moved and all(n.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for n in moved)
    frozen = {k: v for k, v in learner.model.get_base_model().state_dict().items() if ".lora_" not in k}
    assert all(torch.equal(frozen[k], base[k.replace(".base_layer.", ".")]) for k in frozen)  # base frozen

    # an engine loading the push scores tokens as the trainer does
    engine = load_model(tiny_model)
    engine.load_state_dict(merged)  # strict: the plain model's names, every one
    ids = torch.tensor([[5, 17, 230, 99, 401, 12, 7, 300]])
    mismatch = (_logprobs(engine, ids) - _logprobs(learner.model, ids)).abs().max().item()
    assert mismatch < 1e-5

    # the checkpoint exports the merged model and its adapter; both load with their libraries
    import transformers
    from peft import PeftModel

    checkpoint = learner.loaded
    assert checkpoint is not None
    out = export_policy(_run(tiny_model), checkpoint, tmp_path / "final", run_id="lora-test")
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert all(torch.equal(t, merged[n]) for n, t in exported.state_dict().items() if n in merged)
    adapted = PeftModel.from_pretrained(load_model(tiny_model), str(out / "adapter"))
    torch.testing.assert_close(_logprobs(adapted, ids), _logprobs(exported, ids), rtol=0, atol=1e-5)

    # a restarted trainer resumes the same policy from the checkpoint
    resumed = Learner(LearnJob.of(_run(tiny_model)), tmp_path / "ckpt")
    assert resumed.resume() == checkpoint
    again = resumed._plain_state()
    assert all(torch.equal(again[n], merged[n]) for n in merged)


def test_lora_settings_that_cannot_work_are_refused(tiny_model: ModelConfig, tmp_path: Path) -> None:
    from pydantic import ValidationError

    base = {"model": tiny_model.model_dump()}
    with pytest.raises(ValidationError, match="fsdp"):
        RunConfig.model_validate({**base, "training": {"lora": {"rank": 4}, "fsdp": 2}})
    with pytest.raises(ValidationError, match="hybrid"):
        RunConfig.model_validate(
            {
                **base,
                "training": {"lora": {}},
                "planner": {"hybrid": {"workers": 1}},
                "rollout": {"engines": 2},
            }
        )
    bad = RunConfig.model_validate({**base, "training": {"lora": {"targets": ["no_such_proj"]}}})
    with pytest.raises(ValueError, match="training.lora.targets"):
        Learner(LearnJob.of(bad), tmp_path / "ckpt")
