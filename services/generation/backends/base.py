"""The interfaces rollout backends implement, and the plain types they speak.

Two shapes of backend:

- A `StepBackend` (hf, emulated) is driven one decode iteration at a time by the engine's
  continuous batcher (`services.generation.engine.ContinuousEngine`): between two iterations
  requests join and leave, and new weights land. It never runs two calls at once, so it needs no
  locking of its own.
- A backend with its own iteration-level scheduler (vllm's AsyncLLM) implements the engine
  interface itself (`Engine`, see `backends/vllm.py`).

Every engine, whichever shape, serves one weight version at a time (`VersionGate`).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class GenRequest:
    """One sequence to continue. `temperature <= 0` means greedy decoding. Lower `priority` is
    admitted first (the scheduler's C-MLFQ level); equal priorities are first come, first served."""

    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    stop: list[str] = field(default_factory=list)
    priority: int = 0
    min_new_tokens: int = 0
    """No EOS and no stop string ends the request before this many tokens (EOS is masked out of
    the sampling distribution until then, as vLLM's `min_tokens` does)."""
    top_p: float = 1.0
    """Nucleus sampling; below 1 the reported logprobs are under the truncated distribution."""
    prompt_id: str = ""
    group_id: str = ""
    """The task prompt and GRPO group this sequence samples (what the engine's drafter indexes
    its responses by, `services/generation/drafter.py`); empty when unknown."""
    seed: int | None = None
    """Sampling seed: the `hf` backend samples the token at each position with noise keyed by the
    seed and the position (`sampling.noise_key`), so the same seed, context and weights give the
    same tokens, with speculative decoding or without (vLLM: its per-request seed). None: the
    engine draws one."""
    on_tokens: Callable[[list[int]], None] | None = field(default=None, repr=False, compare=False)
    """Called with each run of tokens the engine appends to the sequence, as they are sampled
    (a streamed turn, `TurnRequest.stream`); it must not block. The tokens that end the sequence
    come only in its result."""


@dataclass
class GenOutput:
    """Generated tokens and, per token, its logprob under the sampling distribution and the weight
    version that sampled it.

    The contract shared with the trainer: for a sampled token t at temperature T > 0,
    `logprob = log_softmax(logits / T)[t]` (with top_p < 1: renormalised over the nucleus, -inf
    outside it; no top-k), computed in float32 from the
    weights named by that token's `token_versions` entry. For greedy requests (T <= 0) it is
    `log_softmax(logits)[t]`. Stop strings stay in the output (the tokens completing them were
    sampled and are trained on). A request that was running when new weights arrived continues on
    them: its tokens before the swap carry the old version, those after it the new one.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    token_versions: list[int] = field(default_factory=list)
    drafted: int = 0
    """Drafted tokens verified for this sequence (speculative decoding; 0 without it)."""
    accepted: int = 0
    """...of which the verifier accepted."""


class Backend(abc.ABC):
    """A model replica: what every backend tells the service about itself."""

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
    async def swap_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Replaces (a subset of) the weights; raises ValueError when names or shapes do not fit,
        and then changes nothing."""

    def weight_slots(self) -> dict[str, Any] | None:
        """The model's tensors by name, for a push to write into in place (and to apply sparse
        deltas to); None when the backend loads whole tensors instead (`load_tensors`)."""
        return None

    async def load_tensors(self, items: list[tuple[str, Any]]) -> None:
        """Loads whole tensors (backends without `weight_slots`)."""
        raise NotImplementedError(f"backend {self.name!r} takes no whole-tensor loads")

    async def weights_loaded(self, version: int) -> None:
        """Called once a push has been applied, before the version is taken (an emulated replica
        stalls here for its load time)."""
        return None

    @abc.abstractmethod
    def decode(self, token_ids: list[int]) -> str:
        """Text of generated tokens, special tokens skipped."""

    def free_kv_tokens(self) -> int:
        """KV-cache tokens free now, for the scheduler's placement; -1 when the backend cannot tell
        (hf grows its cache per request and reports a capacity in sequences instead)."""
        return -1

    def make_engine(self, max_batch: int) -> Any:
        """A backend that schedules its own iterations returns its engine here (see
        `Engine`); step backends run under the continuous batcher."""
        raise TypeError(f"backend {self.name!r} is neither a StepBackend nor brings an engine")

    async def close(self) -> None:
        return None


@dataclass
class Join:
    """A row entering the running batch: its whole context is prefilled, then it decodes."""

    slot: int
    context: list[int]
    temperature: float
    request: GenRequest | None = None


class StepBackend(Backend):
    """A backend the continuous batcher drives one iteration at a time."""

    recompute_on_swap: bool = True
    """After new weights land, running rows re-prefill their context with them (their KV was
    computed by the old weights), as AReaL's interruptible generation does; the engine then passes
    every running row as a join with `reset=True`."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset()

    verifies_drafts: bool = False
    """`step` takes drafted tokens and verifies them (speculative decoding)."""

    @abc.abstractmethod
    async def step(
        self,
        joins: list[Join],
        leaves: list[int],
        reset: bool,
        no_eos: frozenset[int] = frozenset(),
        drafts: Mapping[int, Sequence[int]] | None = None,
    ) -> dict[int, list[tuple[int, float]]]:
        """One iteration. First drops the rows in `leaves` (or every row, when `reset`), then
        samples one token for each row still running and prefills `joins`, sampling each one's
        first token; rows in `no_eos` may not sample EOS (below their min_new_tokens). A running
        row with drafted tokens in `drafts` (only where `verifies_drafts`) verifies them in the
        same forward: it emits the accepted ones and one more, distributed exactly as plain
        decoding would emit them (`sampling.verify_draft`). Returns slot -> the (token id, logprob)
        pairs each row running after the step emitted, in order."""

    def admits(self, running_tokens: int, context: int) -> bool:
        """Whether a request with `context` tokens fits next to rows holding `running_tokens`
        tokens of KV (the engine's batch size limit applies on top)."""
        return True

    def interrupt(self) -> None:
        """Work waits for the step to end (a request, new weights, a hand-back): a backend whose
        step runs several iterations (`EmulatedBackend`) ends it at the end of the iteration
        running now. A backend that runs one iteration per step has nothing to do."""


class EngineClosed(Exception):
    """The engine stopped before the request finished; the caller hands it back."""


@dataclass
class Finished:
    output: GenOutput
    policy_version: int
    """Version of the request's first generated token (the oldest; see `output.token_versions`)."""
    queue_s: float
    generate_s: float


class Engine(Protocol):
    """What the service drives: the continuous batcher below, or a backend with its own (vllm)."""

    version: int
    checksum: str
    tokens_generated: int
    max_batch: int

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    def start(self) -> None: ...

    async def submit(self, req: GenRequest) -> Finished: ...

    async def wait_for_version(self, version: int, timeout: float) -> bool: ...

    async def swap_weights(self, state_dict: dict[str, Any], version: int, checksum: str) -> bool: ...

    async def apply_update(
        self,
        version: int,
        checksum: str,
        consume: Callable[[], Awaitable[None]],
        dirty: Callable[[], bool],
    ) -> bool:
        """Runs `consume` (which writes the new weights in place) with generation paused; False
        (nothing run) if `version` is not newer. If it raises after writing (`dirty()`), the
        engine is torn until a full push lands."""
        ...

    @property
    def torn(self) -> bool: ...

    async def close(self, timeout: float) -> None: ...


class VersionGate:
    """The weight version an engine serves, and waiting for a newer one (shared by every engine)."""

    log: Any
    """The engine's logger (set by the engine)."""

    def __init__(self) -> None:
        self.version = 0
        self.checksum = ""
        self._torn = False
        self._closed = False
        self._version_changed = asyncio.Condition()

    @property
    def torn(self) -> bool:
        """A push failed after it had started writing: the weights are neither version."""
        return self._torn

    def _tear(self) -> None:
        self._torn, self.checksum = True, ""

    async def _write_or_tear(
        self,
        version: int,
        consume: Callable[[], Awaitable[None]],
        dirty: Callable[[], bool],
        on_clean_failure: Callable[[], Awaitable[Any]] | None = None,
    ) -> None:
        """Runs `consume` (new weights written in place); if it raises after writing (`dirty()`)
        the engine is torn until a full push lands, if before, `on_clean_failure` runs."""
        try:
            await consume()
        except BaseException:
            if dirty():
                self._tear()
                self.log.error("weights_torn", policy_version=self.version, failed_version=version)
            elif on_clean_failure is not None:
                await on_clean_failure()
            raise

    async def _swapped(self, version: int, running: int) -> None:
        """Announces a new live version (to waiters and in the log)."""
        await self._announce()
        self.log.info("weights_swapped", policy_version=version, running=running)

    async def wait_for_version(self, version: int, timeout: float) -> bool:
        """Waits until weights of at least `version` are live; False on timeout or shutdown."""

        async def reached() -> None:
            async with self._version_changed:
                await self._version_changed.wait_for(lambda: self.version >= version or self._closed)

        try:
            await asyncio.wait_for(reached(), timeout)
        except TimeoutError:
            return False
        return self.version >= version

    async def _announce(self) -> None:
        """Wakes the waiters after the version changed or the engine began to close."""
        async with self._version_changed:
            self._version_changed.notify_all()
