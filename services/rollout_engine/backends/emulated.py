"""EMULATED backend: random tokens with timing from a cost model, for control-plane scale tests only.

No model is loaded and nothing it outputs means anything; it exists so hundreds of engines can run on
one machine to exercise routing, planning and weight sync. A batch takes

    prefill_s_per_token * sum(context lengths)
      + sum over decode steps of (decode_s_per_step + decode_s_per_seq * sequences still running)

Output lengths are uniform in 1..max_new_tokens ("length" at the budget, else "stop"), and each
token's logprob is that of a uniform draw, -log(vocab_size).
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from services.common.runconfig import RunConfig
from services.rollout_engine.backends.base import Backend, GenOutput, GenRequest
from services.rollout_engine.config import EngineSettings

VOCAB_SIZE = 49152
MAX_POSITIONS = 8192


def batch_seconds(context_lens: list[int], output_lens: list[int], s: EngineSettings) -> float:
    """The cost model above, as a pure function."""
    prefill = s.emulated_prefill_s_per_token * sum(context_lens)
    decode = 0.0
    for step in range(max(output_lens, default=0)):
        running = sum(1 for n in output_lens if n > step)
        decode += s.emulated_decode_s_per_step + s.emulated_decode_s_per_seq * running
    return prefill + decode


class EmulatedBackend(Backend):
    name = "emulated"
    emulated = True

    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.rng = random.Random(settings.seed)

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def max_positions(self) -> int:
        return MAX_POSITIONS

    async def start(self) -> None:
        return None

    async def generate(self, batch: list[GenRequest]) -> list[GenOutput]:
        lens = [self.rng.randint(1, r.max_new_tokens) for r in batch]
        await asyncio.sleep(batch_seconds([len(r.prompt_ids) for r in batch], lens, self.settings))
        lp = -math.log(VOCAB_SIZE)
        return [
            GenOutput(
                [self.rng.randrange(VOCAB_SIZE) for _ in range(n)],
                [lp] * n,
                "length" if n >= r.max_new_tokens else "stop",
            )
            for r, n in zip(batch, lens, strict=True)
        ]

    async def swap_weights(self, state_dict: dict[str, Any], version: int) -> None:
        return None

    def decode(self, token_ids: list[int]) -> str:
        return f"<emulated {len(token_ids)} tokens>"


def create(run: RunConfig, settings: EngineSettings) -> EmulatedBackend:
    return EmulatedBackend(settings)
