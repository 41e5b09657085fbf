"""The interface every rollout backend implements, and the plain types it speaks.

The batching engine hands a backend whole batches and swaps weights only between them, so a
backend never needs its own locking: `generate` and `swap_weights` are never called concurrently.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenRequest:
    """One sequence to continue. `temperature <= 0` means greedy decoding."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    stop: list[str] = field(default_factory=list)


@dataclass
class GenOutput:
    """Generated tokens and, per token, its logprob under the sampling distribution.

    The contract shared with the trainer: for a sampled token t at temperature T > 0,
    `logprob = log_softmax(logits / T)[t]`, with top-k/top-p off, computed in float32 from the same
    weights (`policy_version`) that sampled it. For greedy requests (T <= 0) it is
    `log_softmax(logits)[t]`. Stop strings stay in the output (the tokens completing them were
    sampled and are trained on).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


class GenerationAborted(Exception):
    """A batch stopped early because the engine is shutting down."""


class Backend(abc.ABC):
    """A model replica: generates batches and takes new weights between them."""

    name: str = "base"
    emulated: bool = False

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def max_positions(self) -> int:
        """Longest context + generation the model supports."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Loads the model (may take long: call once, before serving)."""

    @abc.abstractmethod
    async def generate(self, batch: list[GenRequest]) -> list[GenOutput]:
        """Generates every request of the batch to completion; outputs are in request order."""

    @abc.abstractmethod
    async def swap_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Replaces (a subset of) the weights; raises ValueError when names or shapes do not fit."""

    @abc.abstractmethod
    def decode(self, token_ids: list[int]) -> str:
        """Text of generated tokens, special tokens skipped."""

    def free_kv_tokens(self) -> int:
        """KV-cache tokens free now, for the scheduler's placement; -1 when the backend cannot tell
        (hf allocates its cache per batch, the emulated backend has none)."""
        return -1

    def abort(self) -> None:
        """Asks a running `generate` to give up soon (shutdown past its grace); it then raises
        GenerationAborted. Called from the event loop while generate may run in a thread."""
        return None

    async def close(self) -> None:
        return None
