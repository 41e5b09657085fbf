"""vLLM backend (GPU nodes): vLLM's async engine (`AsyncLLM`), imported only when this backend is used.

vLLM schedules its own iterations (continuous batching, paged KV cache, chunked prefill), so this
backend brings its own engine (`VllmEngine`) instead of the step loop the hf and emulated backends
share. What it adds on top of vLLM:

- Requests stream their tokens (`RequestOutputKind.DELTA`), are admitted by priority (vLLM's
  `scheduling_policy="priority"`: lower first, as the TurnRequest says), and a caller that gives up
  (task cancelled) aborts its request in vLLM.
- Logprobs follow the engine contract (see GenOutput) with `logprobs_mode="processed_logprobs"`,
  which reports log_softmax(logits / T) of the sampled token.
- New weights are loaded in place without dropping running requests: generation pauses with
  `mode="keep"` (running requests freeze; the caches are cleared, so they re-prefill their context
  with the new weights, as AReaL's interruptible rollout does), every TP worker loads the tensors
  through the model's own `load_weights` (`collective_rpc`), and generation resumes. Tokens that
  arrive before the weights are loaded carry the old version, later ones the new one.
- Load reports read vLLM's scheduler stats (running, waiting, KV cache usage) through a stat logger.

Written against vLLM 0.28 (the `gpu` extra pins it; its torch is the one we pin). Untested on the
CPU-only development machine: `tests/integration/test_vllm_backend.py` runs it where a GPU is.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import itertools
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from services.common.logging import get_logger
from services.common.models import resolve_model_dir
from services.common.runconfig import RunConfig, SpeculativeConfig
from services.generation.backends.base import (
    Backend,
    EngineClosed,
    Finished,
    GenOutput,
    GenRequest,
    VersionGate,
)
from services.generation.config import EngineSettings


def _load_weights_on_worker(worker: Any, items: list[tuple[str, Any]]) -> int:
    """Runs inside each vLLM worker process; the model maps HF names onto its own fused layout."""
    worker.model_runner.get_model().load_weights(weights=items)
    return len(items)


def vllm_speculative_config(spec: SpeculativeConfig) -> dict[str, Any] | None:
    """`rollout.speculative` as vLLM's `speculative_config` (None: off). `ngram` is vLLM's prompt
    lookup; `suffix` its suffix decoding (which needs the `arctic-inference` package on the GPU
    node). vLLM drafts from the engine's own requests only: it knows nothing of GRPO groups, and
    chooses its own draft lengths. Not run here (no GPU)."""
    if spec.method == "off":
        return None
    out: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_tokens}
    if spec.method == "ngram":
        out |= {"prompt_lookup_min": 2, "prompt_lookup_max": 5}
    return out


class VllmBackend(Backend):
    name = "vllm"

    def __init__(self, run: RunConfig, settings: EngineSettings):
        self.run = run
        self.settings = settings
        self.llm: Any = None
        self.tok: Any = None
        self.stats: Any = None
        """vLLM's latest SchedulerStats (num_running_reqs, num_waiting_reqs, kv_cache_usage)."""
        self.kv_tokens = 0
        self.log = get_logger(component="vllm_backend")

    @property
    def vocab_size(self) -> int:
        return int(self.llm.model_config.get_vocab_size())

    @property
    def max_positions(self) -> int:
        return int(self.llm.model_config.max_model_len)

    async def start(self) -> None:
        # collective_rpc ships a function to the workers; vLLM's msgpack channel refuses callables
        # without this (read once at startup, so it is set before the engine exists)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        backend = self

        class _Stats(StatLoggerBase):  # type: ignore[misc]
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any) -> None:
                if scheduler_stats is not None:
                    backend.stats = scheduler_stats

            def log_engine_initialized(self) -> None:
                pass

        model_dir = await asyncio.to_thread(resolve_model_dir, self.run.model)
        args = AsyncEngineArgs(
            model=str(model_dir),
            tensor_parallel_size=self.settings.tensor_parallel,
            max_num_seqs=self.run.rollout.max_batch,
            logprobs_mode="processed_logprobs",
            seed=self.settings.seed or 0,
            enable_prefix_caching=True,
            scheduling_policy="priority",
            gpu_memory_utilization=self.settings.gpu_memory_utilization,
            enable_log_requests=False,
            speculative_config=vllm_speculative_config(self.run.rollout.speculative),
        )
        self.llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[_Stats])
        tok = self.llm.get_tokenizer()
        self.tok = await tok if inspect.isawaitable(tok) else tok
        cache = self.llm.vllm_config.cache_config
        self.kv_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
        self.log.info(
            "model_loaded",
            model=str(model_dir),
            tensor_parallel=self.settings.tensor_parallel,
            kv_cache_tokens=self.kv_tokens,
        )

    def free_kv_tokens(self) -> int:
        if self.stats is None or not self.kv_tokens:
            return -1
        return int(self.kv_tokens * (1.0 - float(self.stats.kv_cache_usage)))

    async def swap_weights(self, state_dict: dict[str, Any], version: int) -> None:
        items = list(state_dict.items())
        await self.llm.pause_generation(mode="keep", clear_cache=True)
        try:
            await self.llm.collective_rpc(_load_weights_on_worker, args=(items,))
        finally:
            await self.llm.resume_generation()

    async def load_tensors(self, items: list[tuple[str, Any]]) -> None:
        """Whole tensors as a push assembles them, while generation is paused (`apply_update`)."""
        await self.llm.collective_rpc(_load_weights_on_worker, args=(items,))

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tok.decode(token_ids, skip_special_tokens=True))

    def make_engine(self, max_batch: int) -> VllmEngine:
        return VllmEngine(self, max_batch)

    async def close(self) -> None:
        if self.llm is not None:
            await asyncio.to_thread(self.llm.shutdown)


class VllmEngine(VersionGate):
    """The engine interface over AsyncLLM: one streaming `generate` per request."""

    def __init__(self, backend: VllmBackend, max_batch: int):
        super().__init__()
        self.backend = backend
        self.max_batch = max_batch
        self.tokens_generated = 0
        self.in_flight = 0
        self._sampling_version = 0
        self._ids = itertools.count()
        self._swap = asyncio.Lock()
        self._active: set[str] = set()
        self.log = get_logger(component="vllm_engine")

    @property
    def running(self) -> int:
        s = self.backend.stats
        return int(s.num_running_reqs) if s is not None else self.in_flight

    @property
    def waiting(self) -> int:
        s = self.backend.stats
        return int(s.num_waiting_reqs) if s is not None else 0

    def start(self) -> None:
        return None

    async def submit(self, req: GenRequest) -> Finished:
        if self._closed:
            raise EngineClosed("engine is shutting down")
        request_id = f"req-{next(self._ids)}"
        self._active.add(request_id)
        self.in_flight += 1
        try:
            return await self._generate(req, request_id)
        finally:
            self.in_flight -= 1
            self._active.discard(request_id)

    async def _generate(self, req: GenRequest, request_id: str) -> Finished:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            temperature=max(req.temperature, 0.0),
            top_p=req.top_p,
            max_tokens=req.max_new_tokens,
            min_tokens=min(req.min_new_tokens, req.max_new_tokens),
            stop=req.stop or None,
            include_stop_str_in_output=True,
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
            seed=req.seed,
        )
        ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        finish: str | None = None
        started = time.monotonic()
        first: float | None = None
        stream = self.backend.llm.generate(
            {"prompt_token_ids": list(req.prompt_ids)},
            params,
            request_id,
            priority=req.priority,
        )
        async with contextlib.aclosing(stream):
            async for out in stream:
                c = out.outputs[0]
                new = list(c.token_ids)
                if new and first is None:
                    first = time.monotonic()
                # DELTA outputs may merge several steps; only the last len(new) logprobs are new
                steps = list(c.logprobs or [])[-len(new) :] if new else []
                for token, step in zip(new, steps, strict=True):
                    ids.append(token)
                    lps.append(float(step[token].logprob))
                    versions.append(self._sampling_version)
                if out.finished:
                    finish = c.finish_reason
        if finish == "abort" or finish is None:
            raise EngineClosed(f"vLLM ended the request ({finish or 'no final output'})")
        self.tokens_generated += len(ids)
        now = time.monotonic()
        output = GenOutput(ids, lps, "length" if finish == "length" else "stop", versions)
        # vLLM does not report queueing apart: time to the first token counts as generation
        return Finished(output, versions[0] if versions else self.version, 0.0, now - started)

    async def swap_weights(self, state_dict: dict[str, Any], version: int, checksum: str) -> bool:
        async with self._swap:
            if version <= self.version:
                return False
            await self.backend.swap_weights(state_dict, version)
            self.version, self.checksum, self._sampling_version = version, checksum, version
        await self._swapped(version, self.running)
        return True

    async def apply_update(
        self,
        version: int,
        checksum: str,
        consume: Callable[[], Awaitable[None]],
        dirty: Callable[[], bool],
    ) -> bool:
        """Generation pauses (running requests kept, prefix cache cleared) while `consume` loads the
        pushed tensors; a push torn mid-way leaves generation paused until a full one lands."""
        async with self._swap:
            if version <= self.version:
                return False
            if not self.torn:
                await self.backend.llm.pause_generation(mode="keep", clear_cache=True)
            await self._write_or_tear(version, consume, dirty, self.backend.llm.resume_generation)
            self.version, self.checksum, self._sampling_version = version, checksum, version
            self._torn = False
            await self.backend.llm.resume_generation()
        await self._swapped(version, self.running)
        return True

    async def close(self, timeout: float) -> None:
        """Stops taking work and lets running requests finish for up to `timeout` seconds; then
        aborts the rest in vLLM, and their callers get EngineClosed."""
        self._closed = True
        await self._announce()
        deadline = time.monotonic() + timeout
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._active:
            self.log.warning("requests_aborted", running=len(self._active))
            await self.backend.llm.abort(list(self._active))


def create(run: RunConfig, settings: EngineSettings) -> VllmBackend:
    return VllmBackend(run, settings)
