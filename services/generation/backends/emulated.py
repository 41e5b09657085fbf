"""EMULATED backend: random tokens with iteration timing from the cost model, for control-plane
scale tests only.

No model is loaded and nothing it outputs means anything; it exists so dozens of engines, each
pretending to be one GPU replica of a named model on a named GPU (`rollout.emulated`, presets in
`services/common/presets/`) at its bucket's tensor-parallel degree, can run on one small machine to exercise routing, planning and
weight sync. It runs under the same continuous batcher as the hf backend; one iteration takes

    time_scale * (prefill_s(tokens of the rows that join) + decode_step_s(rows decoding, their mean context))

with both terms from `services.common.cost_model.CostModel` (the simulator's and the planner's
model), and a request is admitted only while the KV cache of that replica has room for its context.
Taking new weights stalls the replica for `engine_load_s(tp)` (times time_scale), as the
simulator charges it. Like vLLM, it keeps a prefix cache of 16-token KV blocks (chained hashes of
the token ids): a finished request's blocks stay cached while the KV cache has room, least
recently used evicted first, so a trajectory's next turn on the same engine prefills only what is
new (its tool return); new weights clear the cache.
Output lengths are uniform in min_new_tokens..max_new_tokens (exact when the two are equal, as the
synthetic task asks): the last token is EOS ("stop"), unless the length drawn is the whole budget
("length"). Every token's logprob is that of a uniform draw, -log(vocab_size).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.cost_model import CostModel
from services.common.runconfig import EmulatedConfig, EngineJob
from services.generation.backends.base import Join, StepBackend
from services.generation.config import EngineSettings

VOCAB_SIZE = 49152
EOS = 0
BLOCK = 16
MAX_COALESCED = 64
"""Most iterations one step runs (while no row ends and the engine has no news for it)."""
"""KV-cache block size in tokens (vLLM's default): the prefix cache's unit."""


@dataclass
class _Row:
    held: int
    """Tokens in the KV cache: context plus generated so far."""
    left: int
    """Tokens still to generate."""
    eos_at_end: bool
    ids: list[int]


class EmulatedBackend(StepBackend):
    name = "emulated"
    emulated = True

    def __init__(self, settings: EngineSettings, emulated: EmulatedConfig | None = None):
        self.settings = settings
        self.config = emulated or EmulatedConfig()
        self.cm: CostModel = self.config.costs()
        self.set_tensor_parallel(settings.tensor_parallel)
        self.rng = random.Random(settings.seed)
        self.rows: dict[int, _Row] = {}
        self.cache: OrderedDict[int, None] = OrderedDict()
        """Prefix cache: hashes of cached KV blocks, least recently used first."""
        self.emulated_s = 0.0
        self.load_s = 0.0
        self.weights_local = False
        """On the trainer's GPUs (lent): new weights come at no network cost, as the simulator has it."""
        self._clock = float("-inf")
        self._news = False
        """The engine has work for the step's end (`interrupt`) since it began."""
        self._woken: asyncio.Event | None = None

    def set_tensor_parallel(self, tp: int) -> None:
        """The TP this replica pretends to span: its bucket's, once the planner assigns one."""
        self.tp = tp
        self.kv_capacity = self.cm.kv_capacity_tokens(tp)

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def max_positions(self) -> int:
        return self.cm.model.max_context or 1 << 20

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset({EOS})

    async def start(self) -> None:
        return None

    def iteration_s(
        self, join_tokens: list[int], decode_contexts: list[int], cached: list[int] | None = None
    ) -> float:
        """Emulated seconds of one iteration (before `time_scale`): prefill of the joining rows'
        tokens not in the prefix cache (`cached` of each are), and one decode step of the others."""
        before = cached or [0] * len(join_tokens)
        prefill = sum(self.cm.prefill_s(n, c, self.tp) for n, c in zip(join_tokens, before, strict=True))
        decode = 0.0
        if decode_contexts:
            avg = sum(decode_contexts) / len(decode_contexts)
            decode = self.cm.decode_step_s(len(decode_contexts), avg, self.tp)
        return prefill + decode

    async def step(
        self,
        joins: list[Join],
        leaves: list[int],
        reset: bool,
        no_eos: frozenset[int] = frozenset(),
        drafts: Mapping[int, Sequence[int]] | None = None,
    ) -> dict[int, list[tuple[int, float]]]:
        previous: dict[int, _Row] = {}
        if reset:  # new weights: running rows re-prefill everything
            previous, self.rows = self.rows, {}
        for slot in leaves:
            row = self.rows.pop(slot, None)
            if row is not None:
                self._remember(row.ids)
        decoding = [row.held for row in self.rows.values()]
        new_tokens, cached = [], []
        for j in joins:
            hit = 0 if j.slot in previous else self._cached_prefix(j.context)
            new_tokens.append(len(j.context) - hit)
            cached.append(hit)
            if j.slot in previous:  # re-prefilled after new weights: same length as planned
                old = previous[j.slot]
                self.rows[j.slot] = _Row(len(j.context), old.left, old.eos_at_end, list(j.context))
                continue
            budget = j.request.max_new_tokens if j.request is not None else 1
            least = min(budget, j.request.min_new_tokens) if j.request is not None else 1
            n = self.rng.randint(max(1, least), budget)
            self.rows[j.slot] = _Row(len(j.context), n, n < budget, list(j.context))
        self._news = False  # what the engine sent before this step, this step has admitted
        durations = [self.iteration_s(new_tokens, decoding, cached)]
        if self.rows and not drafts:  # the iterations after it, until the first row ends
            n = min(MAX_COALESCED, min(row.left for row in self.rows.values()))
            mean = sum(row.held for row in self.rows.values()) / len(self.rows)
            durations += [self.cm.decode_step_s(len(self.rows), mean + i, self.tp) for i in range(1, n)]
        done = await self._advance(durations)
        self.emulated_s += sum(durations[:done])
        lp = -math.log(VOCAB_SIZE)
        out: dict[int, list[tuple[int, float]]] = {}
        for slot, row in self.rows.items():
            emitted = []
            for _ in range(done):
                row.held += 1
                row.left -= 1
                token = EOS if row.left <= 0 and row.eos_at_end else self.rng.randrange(1, VOCAB_SIZE)
                row.ids.append(token)
                emitted.append((token, lp))
            out[slot] = emitted
        return out

    def interrupt(self) -> None:
        self._news = True
        if self._woken is not None:
            self._woken.set()

    def _hashes(self, ids: list[int]) -> list[int]:
        """Chained hashes of the full KV blocks of a token sequence (vLLM's prefix-cache keys)."""
        out, h = [], 0
        for i in range(0, len(ids) - len(ids) % BLOCK, BLOCK):
            h = hash((h, tuple(ids[i : i + BLOCK])))
            out.append(h)
        return out

    def _cached_prefix(self, context: list[int]) -> int:
        """Tokens of `context` whose KV is in the prefix cache (whole blocks from the start)."""
        hit = 0
        for h in self._hashes(context):
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hit += BLOCK
        return min(hit, len(context) - 1)  # the last token is always computed

    def _remember(self, ids: list[int]) -> None:
        """A finished request's blocks stay cached, least recently used evicted first, in the KV
        cache the running rows leave free."""
        for h in self._hashes(ids):
            self.cache[h] = None
            self.cache.move_to_end(h)
        room = max(0, (self.kv_capacity - sum(r.held for r in self.rows.values())) // BLOCK)
        while len(self.cache) > room:
            self.cache.popitem(last=False)

    async def _advance(self, durations: list[float]) -> int:
        """Sleeps until the replica's own clock has moved past the iterations of `durations`
        (emulated seconds each, times time_scale) from where the previous one ended, so the event
        loop's wake-up delays and this process's own work do not add up into a slower replica than
        the one it pretends to be. A clock more than a second behind (the engine was idle, or the
        machine could not keep up) starts afresh. When the engine has news for it (`interrupt`),
        it stops at the end of the iteration running then. Returns the iterations it ran (>= 1).

        Running the iterations up to the first row's end in one sleep, rather than a wake-up per
        token, is what lets hundreds of emulated engines share two cores: the same iterations, at
        the same times, as one at a time (tests/unit/test_engine_batching.py)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if self._clock < now - 1.0:
            self._clock = now
        ends, at = [], self._clock
        for d in durations:
            at += d * self.config.time_scale
            ends.append(at)
        done = len(ends)
        if len(ends) > 1 and not self._news:
            self._woken = asyncio.Event()
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), max(0.0, ends[-1] - loop.time()))
            finally:
                self._woken = None
            now = loop.time()  # the iteration running now ends before the step does
            done = min(len(ends), 1 + sum(1 for e in ends if e <= now))
        elif len(ends) > 1:
            done = 1
        self._clock = ends[done - 1]
        await asyncio.sleep(max(0.0, self._clock - loop.time()))
        return done

    def admits(self, running_tokens: int, context: int) -> bool:
        return running_tokens + context <= self.kv_capacity

    def free_kv_tokens(self) -> int:
        return max(0, self.kv_capacity - sum(row.held for row in self.rows.values()))

    async def weights_loaded(self, version: int) -> None:
        await self.swap_weights({}, version)

    async def swap_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Stalls as long as the replica it pretends to be takes to receive and load the full
        weights (`engine_load_s`: each TP shard over the network in parallel, plus the fixed
        coordination cost); the tensors pushed (a small stand-in model) are not kept."""
        self.cache.clear()  # KV computed with the old weights is worthless (vLLM resets its cache)
        # lent by the trainer, the weights are its own GPUs' (the lending switch reshards them)
        self.load_s = 0.0 if self.weights_local else self.cm.engine_load_s(self.tp)
        self.emulated_s += self.load_s
        await self._advance([self.load_s])

    def decode(self, token_ids: list[int]) -> str:
        return f"<emulated {len(token_ids)} tokens>"


def create(job: EngineJob, settings: EngineSettings) -> EmulatedBackend:
    return EmulatedBackend(settings, job.rollout.emulated)
