"""vLLM backend (GPU nodes): a thin adapter over `vllm.LLM`, imported only when this backend is used.

Logprobs follow the engine contract (see GenOutput) only with `logprobs_mode="processed_logprobs"`,
which makes vLLM report log_softmax(logits / T) instead of raw-logit logprobs. New weights are loaded
in place with the model's own `load_weights`, through `collective_rpc` so every TP worker gets them.
Untested on the CPU-only development machine.
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.common.logging import get_logger
from services.common.models import resolve_model_dir
from services.common.runconfig import RunConfig
from services.rollout_engine.backends.base import Backend, GenOutput, GenRequest
from services.rollout_engine.config import EngineSettings


def _load_weights_on_worker(worker: Any, items: list[tuple[str, Any]]) -> None:
    """Runs inside each vLLM worker process; the model maps HF names onto its own fused layout."""
    worker.model_runner.model.load_weights(weights=items)


class VllmBackend(Backend):
    name = "vllm"

    def __init__(self, run: RunConfig, settings: EngineSettings):
        self.run = run
        self.settings = settings
        self.llm: Any = None
        self.tok: Any = None
        self.log = get_logger(component="vllm_backend")

    @property
    def vocab_size(self) -> int:
        return int(self.llm.llm_engine.model_config.get_vocab_size())

    @property
    def max_positions(self) -> int:
        return int(self.llm.llm_engine.model_config.max_model_len)

    async def start(self) -> None:
        import vllm

        model_dir = await asyncio.to_thread(resolve_model_dir, self.run.model)
        self.llm = await asyncio.to_thread(
            vllm.LLM,
            model=str(model_dir),
            tensor_parallel_size=self.settings.tensor_parallel,
            max_num_seqs=self.run.rollout.max_batch,
            logprobs_mode="processed_logprobs",
            seed=self.settings.seed,
            enable_prefix_caching=True,
        )
        self.tok = self.llm.get_tokenizer()
        self.log.info("model_loaded", model=str(model_dir), tensor_parallel=self.settings.tensor_parallel)

    async def generate(self, batch: list[GenRequest]) -> list[GenOutput]:
        return await asyncio.to_thread(self._generate, batch)

    def _generate(self, batch: list[GenRequest]) -> list[GenOutput]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in batch]
        params = [
            SamplingParams(
                temperature=max(r.temperature, 0.0),
                max_tokens=r.max_new_tokens,
                stop=r.stop or None,
                include_stop_str_in_output=True,
                logprobs=0,
                seed=None,
            )
            for r in batch
        ]
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        results: list[GenOutput] = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[t].logprob) for t, step in zip(ids, c.logprobs or [], strict=True)]
            results.append(GenOutput(ids, lps, "length" if c.finish_reason == "length" else "stop"))
        return results

    async def swap_weights(self, state_dict: dict[str, Any], version: int) -> None:
        items = list(state_dict.items())
        await asyncio.to_thread(self.llm.collective_rpc, _load_weights_on_worker, args=(items,))
        await asyncio.to_thread(self.llm.reset_prefix_cache)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tok.decode(token_ids, skip_special_tokens=True))


def create(run: RunConfig, settings: EngineSettings) -> VllmBackend:
    return VllmBackend(run, settings)
