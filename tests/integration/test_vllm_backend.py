"""The vLLM backend on a GPU node: same logprob contract as the hf backend, weights reload in place."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from services.common.runconfig import ModelConfig, RunConfig
from services.rollout_engine.backends.base import GenRequest
from services.rollout_engine.config import EngineSettings


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.integration,
    pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (the `gpu` extra)"),
]


async def test_vllm_logprobs_follow_the_contract_and_weights_swap(tiny_model: ModelConfig) -> None:
    import torch

    from services.common.models import load_model
    from services.rollout_engine.backends.vllm import VllmBackend

    run = RunConfig.model_validate(
        {"model": tiny_model.model_dump(), "rollout": {"backend": "vllm", "max_batch": 4}}
    )
    backend = VllmBackend(run, EngineSettings(seed=0))
    await backend.start()
    reference: Any = load_model(tiny_model).cuda().eval()
    reqs = [GenRequest(list(range(100, 120)), 8, 0.8), GenRequest([5, 6, 7], 8, 1.0)]
    outs = await backend.generate(reqs)
    for req, out in zip(reqs, outs, strict=True):
        assert len(out.token_ids) == len(out.logprobs) > 0
        with torch.no_grad():
            logits = reference(torch.tensor([req.prompt_ids + out.token_ids]).cuda()).logits[0].float()
        logp = torch.log_softmax(logits / req.temperature, -1)
        p = len(req.prompt_ids)
        expected = [logp[p - 1 + j, t].item() for j, t in enumerate(out.token_ids)]
        assert out.logprobs == pytest.approx(expected, abs=2e-2)

    greedy = GenRequest(list(range(100, 120)), 8, 0.0)
    before = (await backend.generate([greedy]))[0].token_ids
    g = torch.Generator().manual_seed(0)
    new = {k: v.cpu() + torch.randn(v.shape, generator=g) for k, v in reference.state_dict().items()}
    await backend.swap_weights(new, 1)
    assert (await backend.generate([greedy]))[0].token_ids != before
