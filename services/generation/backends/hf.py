"""Hugging Face backend (torch + transformers, CPU or GPU): one continuous-batching iteration per step.

The running rows share one KV cache, right-aligned: each row's tokens end at the last column and
the attention mask hides the padding on their left, while position ids count each row's own
tokens, so a row computes exactly what it would alone. A step drops the rows that left (trimming
columns nobody uses any more), decodes one token for every running row, and prefills the rows that
join in a batch of their own whose cache is then padded and stacked onto the running one. The torch
work runs in a worker thread so the event loop keeps serving NATS and gRPC meanwhile.

With speculative decoding (`services/generation/speculator.py`) a step verifies the running
rows' drafted tokens in the same forward: each row's last token and its draft enter as new columns
(a row with a shorter draft is padded on the left of them, so every row still ends at the last
column), the verifier keeps the accepted prefix and one more token (`sampling.verify_drafts`), and
the columns of rejected drafted tokens are masked out of the cache — rolled back. Positions count
each row's own tokens, so those holes change nothing; once they waste more than a quarter of the
cache's width the rows are compacted (their kept columns gathered right-aligned).

Only full-attention caches (`DynamicLayer`) can be stacked this way; a model with sliding-window or
linear-attention layers is refused with a clear error when the first row joins a running batch.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from services.common.logging import get_logger
from services.common.models import load_model, load_tokenizer
from services.common.runconfig import EngineJob, ModelConfig
from services.generation.backends.base import Join, StepBackend
from services.generation.config import EngineSettings
from services.generation.sampling import left_pad, noise_key, sample_next, verify_drafts

COMPACT_MIN_COLUMNS = 32
"""Holes left by rejected drafts are squeezed out of the cache once they waste more columns than
this (and a quarter of its width)."""


def _eos_ids(model: Any, tok: Any) -> set[int]:
    ids: set[int] = set()
    for src in (model.generation_config.eos_token_id, model.config.eos_token_id, tok.eos_token_id):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(int(x) for x in src)
    return ids


def _layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = list(cache.layers)
    if not all(type(layer) is DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise NotImplementedError(
            f"hf continuous batching needs a full-attention KV cache, this model uses {kinds}"
        )
    return [(layer.keys, layer.values) for layer in layers]


def _emitted(
    slots: list[int], tokens: torch.Tensor, logprobs: torch.Tensor
) -> dict[int, list[tuple[int, float]]]:
    """slot -> [(token, logprob)], copied to the host at once (token ids are exact as floats)."""
    host = torch.cat([tokens.float(), logprobs.float()]).tolist()
    n = len(slots)
    return {s: [(int(host[i]), host[n + i])] for i, s in enumerate(slots)}


def _left_pad_kv(kv: torch.Tensor, width: int) -> torch.Tensor:
    """Pads a (batch, heads, columns, dim) tensor with zero columns on the left up to `width`."""
    missing = width - kv.shape[2]
    if missing <= 0:
        return kv
    return torch.cat([kv.new_zeros((kv.shape[0], kv.shape[1], missing, kv.shape[3])), kv], dim=2)


@dataclass
class _Batch:
    """The running rows: slot ids, their shared right-aligned KV cache and attention mask (one
    column per cache column) and each row's last sampled token (not yet in the cache) on the
    device; on the host each row's temperature, top_p, sampling seed and next position — the
    position its last token enters at, which is also how many tokens the row holds in the cache,
    and what keys the noise its next token is sampled with. What the host holds needs no wait
    for the device."""

    slots: list[int]
    cache: Any
    mask: torch.Tensor
    last: torch.Tensor
    temps: list[float]
    top_ps: list[float]
    seeds: list[int]
    at: list[int]

    @classmethod
    def empty(cls, device: torch.device) -> _Batch:
        none = torch.zeros((0,), dtype=torch.long, device=device)
        return cls([], None, none.view(0, 0), none, [], [], [], [])

    def positions(self) -> torch.Tensor:
        """Each row's next position, on the device."""
        return torch.tensor(self.at, device=self.mask.device)

    def without(self, leaving: set[int]) -> _Batch:
        keep = [i for i, s in enumerate(self.slots) if s not in leaving]
        if len(keep) == len(self.slots):
            return self
        if not keep:
            return _Batch.empty(self.mask.device)
        idx = torch.tensor(keep, device=self.mask.device)
        mask = self.mask[idx]
        used = mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else mask.shape[1]
        kv = [(k[idx, :, first:], v[idx, :, first:]) for k, v in _layers(self.cache)]
        return _Batch(
            [self.slots[i] for i in keep],
            DynamicCache(ddp_cache_data=kv),
            mask[:, first:],
            self.last[idx],
            [self.temps[i] for i in keep],
            [self.top_ps[i] for i in keep],
            [self.seeds[i] for i in keep],
            [self.at[i] for i in keep],
        )

    def wasted_columns(self) -> int:
        """Cache columns beyond what the row with the most tokens needs (rejected drafts' holes)."""
        return self.mask.shape[1] - max(self.at) if self.slots else 0

    def compacted(self) -> _Batch:
        """The same rows with each row's cached columns gathered right-aligned, the holes that
        rejected drafts left (masked columns between kept ones) squeezed out: what attention sees
        is unchanged, the cache is as narrow as its longest row."""
        width = max(self.at)
        # masked columns first, then kept ones, each in their order: a row's kept columns end
        # right-aligned, preceded by masked ones when it holds fewer than `width`
        idx = torch.argsort(self.mask, dim=1, stable=True)[:, -width:]

        def gather(t: torch.Tensor) -> torch.Tensor:
            return t.gather(2, idx[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))

        kv = [(gather(k), gather(v)) for k, v in _layers(self.cache)]
        return _Batch(
            self.slots,
            DynamicCache(ddp_cache_data=kv),
            self.mask.gather(1, idx),
            self.last,
            self.temps,
            self.top_ps,
            self.seeds,
            self.at,
        )

    def merged(self, other: _Batch) -> _Batch:
        if not self.slots:
            return other
        width = max(self.mask.shape[1], other.mask.shape[1])
        kv = [
            (
                torch.cat([_left_pad_kv(ka, width), _left_pad_kv(kb, width)]),
                torch.cat([_left_pad_kv(va, width), _left_pad_kv(vb, width)]),
            )
            for (ka, va), (kb, vb) in zip(_layers(self.cache), _layers(other.cache), strict=True)
        ]

        def pad_mask(m: torch.Tensor) -> torch.Tensor:
            return torch.cat([m.new_zeros((m.shape[0], width - m.shape[1])), m], dim=1)

        return _Batch(
            self.slots + other.slots,
            DynamicCache(ddp_cache_data=kv),
            torch.cat([pad_mask(self.mask), pad_mask(other.mask)]),
            torch.cat([self.last, other.last]),
            self.temps + other.temps,
            self.top_ps + other.top_ps,
            self.seeds + other.seeds,
            self.at + other.at,
        )


class HFBackend(StepBackend):
    name = "hf"
    verifies_drafts = True

    def __init__(
        self, model_cfg: ModelConfig, torch_threads: int, seed: int | None = None, model: Any = None
    ):
        """`model`: serve this model object, its own parameters (no copy), on its device — the
        trainer's learner model, whose weights are the version it trained last; else `start`
        loads `model_cfg`'s onto the GPU if there is one."""
        self.model_cfg = model_cfg
        self.torch_threads = torch_threads
        self.seed = seed
        self.model: Any = model
        self.shared = model is not None
        """Whether it serves a model it did not load (its weights change only by their owner)."""
        self.tok: Any = None
        self.device = (
            next(model.parameters()).device
            if model is not None
            else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.row_seeds = random.Random(seed)
        """Draws the sampling seed of a row whose request carries none (`GenRequest.seed`)."""
        self.batch = _Batch.empty(self.device)
        self.log = get_logger(component="hf_backend")

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    async def start(self) -> None:
        self.tok = await asyncio.to_thread(load_tokenizer, self.model_cfg)
        if not self.shared:  # a shared model's threads and mode are its owner's
            torch.set_num_threads(self.torch_threads)
            self.model = await asyncio.to_thread(load_model, self.model_cfg)
            self.model.to(self.device).eval()
        self.eos = _eos_ids(self.model, self.tok)
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else min(self.eos)
        self.log.info(
            "model_loaded",
            source=self.model_cfg.source,
            params=sum(p.numel() for p in self.model.parameters()),
            device=str(self.device),
            torch_threads=torch.get_num_threads(),
            shared=self.shared,
        )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.eos)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tok.decode(token_ids, skip_special_tokens=True))

    def _seed(self, join: Join) -> int:
        req = join.request
        return req.seed if req is not None and req.seed is not None else self.row_seeds.getrandbits(63)

    async def step(
        self,
        joins: list[Join],
        leaves: list[int],
        reset: bool,
        no_eos: frozenset[int] = frozenset(),
        drafts: Mapping[int, Sequence[int]] | None = None,
    ) -> dict[int, list[tuple[int, float]]]:
        return await asyncio.to_thread(self.step_sync, joins, leaves, reset, no_eos, drafts)

    def _logits(self, logits: torch.Tensor, slots: list[int], no_eos: frozenset[int]) -> torch.Tensor:
        """Masks EOS for rows below their min_new_tokens (the sampling distribution, logprobs
        included, is then the one without EOS, as with vLLM's min_tokens)."""
        rows = [i for i, s in enumerate(slots) if s in no_eos]
        if not rows:
            return logits
        logits = logits.float().clone()
        logits[
            torch.tensor(rows, device=logits.device).unsqueeze(-1), torch.tensor(sorted(self.eos))
        ] = -math.inf
        return logits

    @torch.inference_mode()
    def step_sync(
        self,
        joins: list[Join],
        leaves: list[int],
        reset: bool,
        no_eos: frozenset[int] = frozenset(),
        drafts: Mapping[int, Sequence[int]] | None = None,
    ) -> dict[int, list[tuple[int, float]]]:
        if reset:
            self.batch = _Batch.empty(self.device)
        elif leaves:
            self.batch = self.batch.without(set(leaves))
        sampled: dict[int, list[tuple[int, float]]] = {}
        if self.batch.slots:
            rows = [list(drafts.get(s, ())) if drafts else [] for s in self.batch.slots]
            sampled.update(self._verify(rows, no_eos) if any(rows) else self._decode(no_eos))
        if joins:
            sampled.update(self._prefill(joins, no_eos))
        return sampled

    def _decode(self, no_eos: frozenset[int]) -> dict[int, list[tuple[int, float]]]:
        """One token for every running row."""
        b = self.batch
        mask = torch.cat([b.mask, b.mask.new_ones((len(b.slots), 1))], dim=1)
        out = self.model(
            input_ids=b.last.unsqueeze(-1),
            attention_mask=mask,
            position_ids=b.positions().unsqueeze(-1),
            past_key_values=b.cache,
            use_cache=True,
        )
        logits = self._logits(out.logits[:, -1, :], b.slots, no_eos)
        draws = [noise_key(seed, at) for seed, at in zip(b.seeds, b.at, strict=True)]
        tokens, logprobs = sample_next(logits, b.temps, top_p=b.top_ps, keys=draws)
        at = [a + 1 for a in b.at]
        self.batch = _Batch(b.slots, out.past_key_values, mask, tokens, b.temps, b.top_ps, b.seeds, at)
        return _emitted(b.slots, tokens, logprobs)

    def _verify(self, drafts: list[list[int]], no_eos: frozenset[int]) -> dict[int, list[tuple[int, float]]]:
        """One forward over every running row's last token and its drafted tokens (rows with fewer
        drafted tokens are padded on the left of the new columns, so every row still ends at the
        last column); each row keeps the accepted prefix of its draft and one more token, and the
        columns of its rejected drafted tokens are masked out of the cache (rolled back). The rows
        are verified together (`sampling.verify_drafts`): on a GPU the step waits for the device
        a fixed number of times, not once per row or drafted token."""
        b = self.batch
        n, width = len(b.slots), 1 + max(len(d) for d in drafts)
        firsts = [width - 1 - len(d) for d in drafts]
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        new = torch.zeros((n, width), dtype=torch.long)
        for i, (d, first) in enumerate(zip(drafts, firsts, strict=True)):
            ids[i, first + 1 :] = torch.tensor(d, dtype=torch.long)
            new[i, first:] = 1
        ids, new = ids.to(self.device), new.to(self.device)
        rows, first_t = torch.arange(n, device=self.device), torch.tensor(firsts, device=self.device)
        ids[rows, first_t] = b.last  # each row's last sampled token, before its draft
        # a row's last token sits at its next position, its drafted tokens after it; the padding
        # before them is masked (its positions are clamped, never seen)
        lens = torch.tensor([len(d) for d in drafts], device=self.device)
        offsets = torch.arange(width, device=self.device) - (width - 1)
        pos = (b.positions().unsqueeze(-1) + offsets.unsqueeze(0) + lens.unsqueeze(-1)).clamp(min=0)
        real = [i * width + c for i, first in enumerate(firsts) for c in range(first, width)]
        cache, logits = self._forward_real(ids, torch.cat([b.mask, new], dim=1), pos, real)
        masked = [s for s in b.slots if s in no_eos]
        if masked:
            counts = [len(d) + 1 for d in drafts]
            logits = self._logits(
                logits, [s for s, c in zip(b.slots, counts, strict=True) for _ in range(c)], no_eos
            )
        draws = [
            [noise_key(seed, at + j) for j in range(len(d) + 1)]
            for seed, at, d in zip(b.seeds, b.at, drafts, strict=True)
        ]
        verdicts = verify_drafts(logits, drafts, b.temps, b.top_ps, keys=draws)
        accepted = [len(tokens) - 1 for tokens, _ in verdicts]
        # the rejected drafted tokens' columns: those after each row's accepted prefix
        cols = torch.arange(width, device=self.device).unsqueeze(0)
        keep_to = first_t + 1 + torch.tensor(accepted, device=self.device)
        kept = new * (cols < keep_to.unsqueeze(-1))
        self.batch = _Batch(
            b.slots,
            cache,
            torch.cat([b.mask, kept], dim=1),
            torch.tensor([tokens[-1] for tokens, _ in verdicts], device=self.device),
            b.temps,
            b.top_ps,
            b.seeds,
            [at + 1 + a for at, a in zip(b.at, accepted, strict=True)],
        )
        wasted = self.batch.wasted_columns()
        if wasted > max(COMPACT_MIN_COLUMNS, self.batch.mask.shape[1] // 4):
            self.batch = self.batch.compacted()
        return {
            slot: list(zip(tokens, logprobs, strict=True))
            for slot, (tokens, logprobs) in zip(b.slots, verdicts, strict=True)
        }

    def _forward_real(
        self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, flat: list[int]
    ) -> tuple[Any, torch.Tensor]:
        """The verify forward: the new cache, and the logits at the real (unpadded) positions, row
        after row (`flat`: their indices in the flattened rows x columns). The output projection
        (for a small model with a large vocabulary, most of a step) runs on the real positions
        only; a model whose head does more than project (soft-capped or scaled logits) runs whole."""
        cfg = self.model.config
        index = torch.tensor(flat, device=self.device)
        if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=self.batch.cache,
                use_cache=True,
            )
            return out.past_key_values, out.logits.flatten(0, 1)[index]
        hidden = self.model.get_decoder()(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=self.batch.cache,
            use_cache=True,
        )
        states = hidden.last_hidden_state.flatten(0, 1)[index]
        return hidden.past_key_values, self.model.get_output_embeddings()(states)

    def _prefill(self, joins: list[Join], no_eos: frozenset[int]) -> dict[int, list[tuple[int, float]]]:
        """Prefills the joining rows in a batch of their own, samples each one's first token and
        stacks their cache onto the running rows'."""
        ids, mask, pos = left_pad([j.context for j in joins], self.pad_id)
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        temps = [float(j.temperature) for j in joins]
        top_ps = [float(j.request.top_p) if j.request else 1.0 for j in joins]
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1
        )
        slots = [j.slot for j in joins]
        logits = self._logits(out.logits[:, -1, :], slots, no_eos)
        seeds = [self._seed(j) for j in joins]
        # a prompt's last token sits at position len - 1: its logits draw the first token
        draws = [noise_key(seed, len(j.context) - 1) for seed, j in zip(seeds, joins, strict=True)]
        tokens, logprobs = sample_next(logits, temps, top_p=top_ps, keys=draws)
        at = [len(j.context) for j in joins]
        joined = _Batch(slots, out.past_key_values, mask, tokens, temps, top_ps, seeds, at)
        self.batch = self.batch.merged(joined)
        return _emitted(slots, tokens, logprobs)

    async def swap_weights(self, state_dict: dict[str, Any], version: int) -> None:
        await asyncio.to_thread(self._copy_weights, state_dict)

    def weight_slots(self) -> dict[str, Any] | None:
        return dict(self.model.state_dict())

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


def create(job: EngineJob, settings: EngineSettings) -> HFBackend:
    return HFBackend(job.model, job.rollout.torch_threads, settings.seed)
