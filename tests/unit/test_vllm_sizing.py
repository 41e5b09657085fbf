"""How the vllm backend sizes vLLM for a machine it shares: KV cache in bytes from the run config,
within the engine's part of the host's memory, the longest turn as its model length."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.runconfig import EngineJob, RunConfig
from services.generation.backends.vllm import (
    MIN_KV_BYTES,
    VllmBackend,
    cpu_kv_bytes,
    kv_bytes_per_token,
    max_model_len,
)
from services.generation.config import EngineSettings

SMOLLM2 = {  # SmolLM2-135M's config.json, the fields the sizing reads
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_size": 576,
    "max_position_embeddings": 8192,
}


def _model(tmp_path: Path, **over: int) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2 | over))
    return tmp_path


def _run(**rollout: object) -> EngineJob:
    return EngineJob.of(
        RunConfig.model_validate(
            {
                "task": {"max_context_tokens": 1024, "max_new_tokens": 64},
                "rollout": {"backend": "vllm", "max_batch": 8} | rollout,
            }
        )
    )


def test_kv_bytes_per_token_follow_the_models_layers_kv_heads_and_dtype(tmp_path: Path) -> None:
    model = _model(tmp_path)
    assert kv_bytes_per_token(model, "float32") == 2 * 30 * 3 * 64 * 4  # 46 KB, K and V
    assert kv_bytes_per_token(model, "bfloat16") == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(_model(tmp_path, head_dim=128), "float32") == 2 * 30 * 3 * 128 * 4


def test_the_longest_turn_bounds_the_model_length_within_the_models_own(tmp_path: Path) -> None:
    assert max_model_len(_model(tmp_path), _run()) == 1024 + 64
    assert max_model_len(_model(tmp_path, max_position_embeddings=512), _run()) == 512


def test_on_a_cpu_the_kv_cache_is_sized_in_bytes_for_twice_the_batch_at_its_longest_turn(
    tmp_path: Path,
) -> None:
    model = _model(tmp_path)
    args = VllmBackend(_run(), EngineSettings()).engine_args(model)
    need = 2 * 8 * (1024 + 64) * kv_bytes_per_token(model, "float32")
    assert args.kv_cache_memory_bytes == need > MIN_KV_BYTES
    assert args.max_model_len == 1088 and args.max_num_seqs == 8 and args.dtype == "float32"
    assert args.enforce_eager and args.scheduling_policy == "priority" and args.enable_prefix_caching
    assert args.logprobs_mode == "processed_logprobs"
    assert args.worker_extension_cls.endswith("vllm_worker.LibraWorkerExtension")

    small = VllmBackend(_run(max_batch=1), EngineSettings()).engine_args(
        _model(tmp_path, num_hidden_layers=1)
    )
    assert small.kv_cache_memory_bytes == MIN_KV_BYTES
    fixed = VllmBackend(_run(), EngineSettings(kv_cache_gib=0.5, vllm_compile=True)).engine_args(model)
    assert fixed.kv_cache_memory_bytes == 1 << 29 and not fixed.enforce_eager


def test_the_jobs_engines_take_at_most_half_the_hosts_memory_for_kv_together(tmp_path: Path) -> None:
    """Two engines of a job with 8k contexts and a batch of 16 need 11.25 GiB of KV each: on a
    24 GiB host each gets a quarter of it, not enough to get the second one killed for memory."""
    gib = 1 << 30
    need = 2 * 16 * 8192 * kv_bytes_per_token(_model(tmp_path), "float32")
    assert need == 11.25 * gib
    host = (24 * gib, 22 * gib)
    assert cpu_kv_bytes(need, 2, host) == 6 * gib  # a quarter of the host
    assert cpu_kv_bytes(need, 1, host) == 11.25 * gib  # one engine: all it needs, within half
    assert cpu_kv_bytes(need, 2, (24 * gib, 4 * gib)) == int(0.8 * 4 * gib)  # what is free now
    assert cpu_kv_bytes(need, 1000, host) == MIN_KV_BYTES
    assert cpu_kv_bytes(1 << 20, 2, host) == MIN_KV_BYTES  # a tiny model still gets the minimum
