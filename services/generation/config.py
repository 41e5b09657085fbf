"""Settings of one rollout-engine process (env prefix LIBRA_ROLLOUT_ENGINE_).

The model, backend and batch size are job-wide and come from the YAML run config (LIBRA_CONFIG);
what is here is per process: where the weight-sync server listens and how this replica behaves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="LIBRA_ROLLOUT_ENGINE_", extra="ignore", use_attribute_docstrings=True
    )

    grpc_host: str = "127.0.0.1"
    """Interface the WeightSync gRPC server binds; 0.0.0.0 advertises this host's name instead."""
    advertise_host: str | None = None
    """Host put in the announced WeightSync address (e.g. a pod IP); unset uses grpc_host, or this
    machine's hostname when grpc_host is a wildcard."""
    grpc_port: int = Field(0, ge=0, le=65535)
    """WeightSync gRPC port; 0 picks a free one (the address is announced in WorkerHello)."""
    max_push_bytes: int = Field(64 << 30, gt=0)
    """Largest weight push accepted; a push that announces more is refused before its first record
    is read. Set it a little above the model's size."""
    push_record_timeout_s: float = Field(30.0, gt=0.0)
    """Generation pauses while a push is applied: a sender that sends no record for this long is
    cut off (the engine is then torn until the trainer's next full push)."""
    bucket: str = Field("", pattern=r"^[a-z0-9_-]{0,32}$")
    """Rollout bucket this replica prefers; empty lets the planner put it in the emptiest bucket of
    the job, and the planner's assignment has the final say."""
    tensor_parallel: int = Field(1, ge=1, le=64)
    """GPUs this replica spans (vllm backend); reported to the planner."""
    load_report_interval_s: float = Field(1.0, gt=0.0, le=60.0)
    """How often the engine looks whether what the scheduler routes by (running and waiting
    requests, the turns it holds, the last one read and answered, weights, bucket) changed, and
    if so publishes an EngineLoad report."""
    load_heartbeat_s: float = Field(5.0, gt=0.0, le=300.0)
    """An EngineLoad (and a MetricSample) at least this often, changed or not: it refreshes the
    engine's tokens/s and KV use, and bounds how long a lost turn goes unnoticed (two reports)."""
    stream_interval_s: float = Field(0.05, ge=0.0, le=10.0)
    """How often a streamed turn (`TurnRequest.stream`: an agent's call with `stream: true`) says
    the tokens it sampled since (TurnProgress); 0: after every engine iteration."""
    max_wait_for_weights_s: float = Field(60.0, ge=0.0, le=3600.0)
    """How long a request whose min_policy_version is ahead of the engine waits for newer weights."""
    max_new_tokens_cap: int = Field(4096, ge=1)
    """Upper bound on a request's max_new_tokens beyond the job's own task.max_new_tokens (which
    always passes); larger requests are refused as invalid."""
    held_context_tokens: int = Field(4_000_000, ge=0)
    """Tokens of trajectories' contexts it keeps after their turns (4 bytes each, the least
    recently used dropped first), so the scheduler's next turn of one sends only what is new; 0
    keeps none (every delta is answered `context_unknown` and sent again whole)."""
    assignment_timeout_s: float = Field(0.0, ge=0.0)
    """Give up when no plan assigns this worker within this time; 0 waits until stopped."""
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    """vllm backend on a GPU: fraction of GPU memory vLLM may take for weights, activations and KV
    cache. On a CPU the KV cache is sized in bytes instead (`kv_cache_gib`): a share of host memory
    would starve the other services on the machine."""
    kv_cache_gib: float | None = Field(None, gt=0.0, le=4096.0)
    """vllm backend on a CPU: host memory for vLLM's KV cache; unset sizes it for twice the job's
    batch at its longest turn (rollout.max_batch x task.max_context_tokens + max_new_tokens), within
    its part of half the host's memory (the job's rollout.engines share it)."""
    vllm_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """vllm backend: the dtype it serves in. float32 keeps its logprobs within ~1e-4 of the float32
    trainer's; bfloat16 is about 1.5x faster on this CPU and 2x on GPUs, at a larger mismatch."""
    vllm_compile: bool = False
    """vllm backend: let vLLM compile the model (torch.compile; CUDA graphs on GPUs). Faster decode,
    about a minute more at start on 2 CPU cores; off runs eager."""
    iteration_log: Path | None = None
    """vllm backend: a directory where the engine appends one JSON line per iteration (its batch,
    decode context, prefill tokens and time; `services/generation/iteration_log.py`), which `libra
    bench live` sets against the cost model. Unset records nothing."""
    seed: int | None = None
    """Sampling seed (hf, emulated); unset draws fresh randomness per process."""
