"""One rollout engine for the weight-sync benchmark, as its own process:
`python -m tools.bench._weight_engine PORT_FILE REDIS_URL RUN_ID SEED`. The hf backend and the
continuous batcher over a random-weight model of SmolLM2-135M's architecture, behind the real
WeightSync server; it writes its port to PORT_FILE and serves until killed."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path


def smollm2_shaped(seed: int):  # type: ignore[no-untyped-def]
    """A random-weight Llama with SmolLM2-135M-Instruct's shapes (its config.json): 30 layers,
    hidden 576, 9 heads / 3 KV heads, MLP 1536, vocabulary 49152, tied embeddings (134.5M params)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg).eval()


async def main(port_file: Path, redis_url: str, run_id: str, seed: int) -> None:
    import torch

    from services.common.ownership import OwnershipStore
    from services.common.runconfig import ModelConfig
    from services.generation.backends.hf import HFBackend
    from services.generation.engine import ContinuousEngine
    from services.rollout_engine.weight_sync import WeightSyncServicer, start_server

    torch.set_num_threads(1)
    backend = HFBackend(ModelConfig(source="tiny-random"), torch_threads=1)
    backend.model = smollm2_shaped(seed)  # serving is not measured here: no tokenizer needed
    engine = ContinuousEngine(backend, max_batch=1)
    engine.start()
    store = OwnershipStore.from_url(redis_url, run_id)
    server, port = await start_server(
        WeightSyncServicer(engine, store, f"bench-{port_file.stem}"), "127.0.0.1", 0
    )
    port_file.write_text(str(port))
    await server.wait_for_termination()


if __name__ == "__main__":
    from services.rollout_engine.weight_sync import limit_malloc_arenas

    limit_malloc_arenas()  # as the engine service does at start
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])))
