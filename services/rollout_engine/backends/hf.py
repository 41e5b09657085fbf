"""Hugging Face backend (torch + transformers, CPU or GPU): a manual KV-cache decode loop.

Each batch is left-padded and prefilled once, then decoded one token per step for all rows; a row
stops at EOS, its own max_new_tokens or a stop string, and the batch ends when every row has. The
torch work runs in a worker thread so the event loop keeps serving NATS and gRPC meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from services.common.logging import get_logger
from services.common.models import load_model, load_tokenizer
from services.common.runconfig import ModelConfig, RunConfig
from services.rollout_engine.backends.base import Backend, GenerationAborted, GenOutput, GenRequest
from services.rollout_engine.config import EngineSettings
from services.rollout_engine.sampling import StopMatcher, left_pad, sample_next


def _eos_ids(model: Any, tok: Any) -> set[int]:
    ids: set[int] = set()
    for src in (model.generation_config.eos_token_id, model.config.eos_token_id, tok.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(x) for x in src)
    return ids


class HFBackend(Backend):
    name = "hf"

    def __init__(self, model_cfg: ModelConfig, torch_threads: int, seed: int | None = None):
        self.model_cfg = model_cfg
        self.torch_threads = torch_threads
        self.seed = seed
        self.model: Any = None
        self.tok: Any = None
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.generator: torch.Generator | None = None
        self._abort = False
        self.log = get_logger(component="hf_backend")

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    async def start(self) -> None:
        torch.set_num_threads(self.torch_threads)
        self.tok = await asyncio.to_thread(load_tokenizer, self.model_cfg)
        self.model = await asyncio.to_thread(load_model, self.model_cfg)
        self.model.to(self.device).eval()
        self.eos = _eos_ids(self.model, self.tok)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else min(self.eos)
        self.generator = torch.Generator(device=self.device)
        if self.seed is not None:
            self.generator.manual_seed(self.seed)
        else:
            self.generator.seed()
        self.log.info(
            "model_loaded",
            source=self.model_cfg.source,
            params=sum(p.numel() for p in self.model.parameters()),
            device=str(self.device),
            torch_threads=self.torch_threads,
        )

    async def generate(self, batch: list[GenRequest]) -> list[GenOutput]:
        return await asyncio.to_thread(self.generate_sync, batch)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tok.decode(token_ids, skip_special_tokens=True))

    @torch.inference_mode()
    def generate_sync(self, batch: list[GenRequest]) -> list[GenOutput]:
        n = len(batch)
        ids, mask, pos = left_pad([r.prompt_ids for r in batch], self.pad_id)
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        temps = torch.tensor([r.temperature for r in batch], device=self.device)
        stops = [StopMatcher(r.stop, lambda t: str(self.tok.decode(t))) for r in batch]
        out_ids: list[list[int]] = [[] for _ in batch]
        out_lp: list[list[float]] = [[] for _ in batch]
        finish: list[str | None] = [None] * n

        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1
        )
        for _ in range(max(r.max_new_tokens for r in batch)):
            tokens, logprobs = sample_next(out.logits[:, -1, :], temps, self.generator)
            tok_list, lp_list = tokens.tolist(), logprobs.tolist()
            for i in range(n):
                if finish[i] is not None:
                    continue
                out_ids[i].append(tok_list[i])
                out_lp[i].append(lp_list[i])
                if tok_list[i] in self.eos or stops[i].matches(out_ids[i]):
                    finish[i] = "stop"
                elif len(out_ids[i]) >= batch[i].max_new_tokens:
                    finish[i] = "length"
            if all(f is not None for f in finish):
                break
            if self._abort:
                raise GenerationAborted(f"aborted after {len(out_ids[0])} decode steps")
            mask = torch.cat([mask, mask.new_ones((n, 1))], dim=1)
            pos = pos[:, -1:] + 1
            out = self.model(
                input_ids=tokens.unsqueeze(-1),
                attention_mask=mask,
                position_ids=pos,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        return [GenOutput(out_ids[i], out_lp[i], finish[i] or "length") for i in range(n)]

    def abort(self) -> None:
        self._abort = True

    async def swap_weights(self, state_dict: dict[str, Any], version: int) -> None:
        await asyncio.to_thread(self._copy_weights, state_dict)

    @torch.no_grad()
    def _copy_weights(self, state_dict: dict[str, Any]) -> None:
        """Copies in place, so tied weights stay tied; every name and shape is checked first, so a
        bad push changes nothing."""
        own = self.model.state_dict()
        unknown = [k for k in state_dict if k not in own]
        if unknown:
            raise ValueError(f"unknown weight names: {unknown[:5]}")
        wrong = [k for k, v in state_dict.items() if tuple(v.shape) != tuple(own[k].shape)]
        if wrong:
            raise ValueError(f"shape mismatch for: {wrong[:5]}")
        for k, v in state_dict.items():
            own[k].copy_(v.to(device=own[k].device, dtype=own[k].dtype))


def create(run: RunConfig, settings: EngineSettings) -> HFBackend:
    return HFBackend(run.model, run.rollout.torch_threads, settings.seed)
