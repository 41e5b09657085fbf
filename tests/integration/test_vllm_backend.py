"""The vLLM backend on a GPU node: same logprob contract as the hf backend, weights reload in place."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from services.common.runconfig import ModelConfig, RunConfig
from services.generation.backends.base import GenRequest
from services.generation.config import EngineSettings


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


async def test_vllm_streams_by_the_logprob_contract_and_swaps_weights_under_load(
    tiny_model: ModelConfig,
) -> None:
    import asyncio

    import torch

    from services.common.models import load_model
    from services.generation.backends.vllm import VllmBackend
    from services.generation.engine import engine_for

    run = RunConfig.model_validate(
        {"model": tiny_model.model_dump(), "rollout": {"backend": "vllm", "max_batch": 4}}
    )
    backend = VllmBackend(run, EngineSettings(seed=0, gpu_memory_utilization=0.3))
    await backend.start()
    engine = engine_for(backend, 4)
    engine.start()
    try:
        reference: Any = load_model(tiny_model).cuda().eval()

        def expected(req: GenRequest, ids: list[int]) -> list[float]:
            with torch.no_grad():
                logits = reference(torch.tensor([req.prompt_ids + ids]).cuda()).logits[0].float()
            logp = torch.log_softmax(logits / (req.temperature or 1.0), -1)
            p = len(req.prompt_ids)
            return [logp[p - 1 + j, t].item() for j, t in enumerate(ids)]

        reqs = [GenRequest(list(range(100, 120)), 8, 0.8), GenRequest([5, 6, 7], 8, 1.0, priority=1)]
        done = await asyncio.gather(*(engine.submit(r) for r in reqs))
        for req, d in zip(reqs, done, strict=True):
            out = d.output
            assert len(out.token_ids) == len(out.logprobs) == len(out.token_versions) > 0
            assert set(out.token_versions) == {0}
            assert out.logprobs == pytest.approx(expected(req, out.token_ids), abs=2e-2)

        greedy = GenRequest(list(range(100, 120)), 8, 0.0)
        before = (await engine.submit(greedy)).output.token_ids
        g = torch.Generator().manual_seed(0)
        new = {k: v.cpu() + torch.randn(v.shape, generator=g) for k, v in reference.state_dict().items()}
        long = [asyncio.create_task(engine.submit(GenRequest([9, 10, 11], 400, 1.0))) for _ in range(3)]
        await asyncio.sleep(0.5)
        assert await engine.swap_weights(new, 1, "v1")
        finished = await asyncio.gather(*long)
        assert all(len(f.output.token_ids) > 0 for f in finished), "no request was lost to the swap"
        assert any(1 in f.output.token_versions for f in finished)
        assert (await engine.submit(greedy)).output.token_ids != before

        cancelled = asyncio.create_task(engine.submit(GenRequest([1, 2, 3], 2000, 1.0)))
        await asyncio.sleep(0.3)
        cancelled.cancel()
        await asyncio.sleep(0.5)
        assert engine.in_flight == 0
    finally:
        await engine.close(timeout=5)
        await backend.close()
