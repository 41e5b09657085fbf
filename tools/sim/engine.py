"""One rollout replica under continuous batching, simulated without an event per token.

Every running sequence advances one token per decode iteration, so the engine keeps a virtual
token clock `v`: a sequence that joins at `v0` needing `n` tokens finishes at `v0 + n`. Between
membership changes the iteration time is constant, so an engine only wakes when a sequence
finishes or another joins. Prefill and weight loading stall decoding (`resume`).

KV cache, as vLLM manages it: a running sequence holds its context plus the tokens it may still
generate; when its turn ends the blocks stay in the prefix cache (evictable, least recently used
first) while the trajectory waits for its tool, so the next turn on the same engine prefills only
the tool return. A weight update invalidates every cached block (vLLM resets the prefix cache) and,
for running sequences, the KV computed with the old weights: they re-prefill their context
(interruptible generation, as in AReaL) unless the engine drained first.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from services.common.cost_model import CostModel


@dataclass(slots=True)
class Request:
    traj_id: str
    tokens: int
    context: int
    """Context at the start of decoding (after prefill)."""
    start_v: float = 0.0


class Engine:
    __slots__ = (
        "accepting",
        "bucket",
        "busy_s",
        "cache",
        "cached_tokens",
        "cm",
        "engine_id",
        "gen",
        "heap",
        "hybrid",
        "kv_capacity",
        "kv_used",
        "max_seqs",
        "n",
        "open_since",
        "opened_s",
        "prompts",
        "resume",
        "s",
        "seq",
        "step",
        "sync_s",
        "t",
        "tp",
        "v",
        "version",
    )

    def __init__(
        self, engine_id: str, bucket: str, tp: int, cm: CostModel, max_seqs: int, hybrid: bool = False
    ):
        self.engine_id = engine_id
        self.bucket = bucket
        self.tp = tp
        self.cm = cm
        self.max_seqs = max_seqs
        self.kv_capacity = cm.kv_capacity_tokens(tp)
        self.kv_used = 0
        self.hybrid = hybrid
        self.accepting = True
        self.heap: list[tuple[float, int, Request]] = []
        self.n = 0
        self.s = 0.0
        self.v = 0.0
        self.t = 0.0
        self.resume = 0.0
        self.step = 0.0
        self.seq = 0
        self.gen = 0
        self.busy_s = 0.0
        self.sync_s = 0.0
        self.opened_s = 0.0
        self.open_since: float | None = None
        self.prompts: dict[str, None] = {}
        self.cache: OrderedDict[str, int] = OrderedDict()
        """Trajectories paused in a tool whose context is still in the prefix cache -> tokens."""
        self.cached_tokens = 0
        self.version = 0
        """Weight version this engine serves."""

    def open(self, now: float) -> None:
        self.t = max(self.t, now)
        self.resume = max(self.resume, now)
        self.open_since = now

    def close(self, now: float) -> None:
        self.advance(now)
        if self.open_since is not None:
            self.opened_s += now - self.open_since
        self.open_since = None

    def fits(self, context: int, reserve: int) -> bool:
        return self.n < self.max_seqs and self.kv_used + context + reserve <= self.kv_capacity

    def advance(self, now: float) -> None:
        if now <= self.t:
            return
        stall_end = min(now, self.resume)
        if stall_end > self.t:
            self.busy_s += stall_end - self.t
        start = max(self.t, self.resume)
        if now > start and self.n:
            self.busy_s += now - start
            self.v += (now - start) / self.step
        self.t = now

    def stall(self, now: float, seconds: float, sync: bool = False) -> None:
        self.advance(now)
        self.resume = max(self.resume, now) + seconds
        if sync:
            self.sync_s += seconds

    def take_cached(self, traj_id: str) -> bool:
        """Claim a paused trajectory's cached context (True) or report that it was evicted."""
        tokens = self.cache.pop(traj_id, None)
        if tokens is None:
            return False
        self.cached_tokens -= tokens
        return True

    def forget(self, traj_id: str) -> None:
        tokens = self.cache.pop(traj_id, None)
        if tokens is not None:
            self.cached_tokens -= tokens

    def drop_cache(self) -> None:
        """Forget every cached prefix (new weights, or the GPU leaves rollout)."""
        self.cache.clear()
        self.cached_tokens = 0
        self.prompts.clear()

    def _evict(self) -> None:
        while self.cache and self.kv_used + self.cached_tokens > self.kv_capacity:
            _, tokens = self.cache.popitem(last=False)
            self.cached_tokens -= tokens

    def join(self, req: Request, now: float, prefill_tokens: int, prompt_id: str) -> None:
        self.advance(now)
        self.resume = max(self.resume, now) + self.cm.prefill_s(
            prefill_tokens, req.context - prefill_tokens, self.tp
        )
        req.start_v = self.v
        self.seq += 1
        heapq.heappush(self.heap, (self.v + req.tokens, self.seq, req))
        self.n += 1
        self.s += req.context - self.v
        self.kv_used += req.context + req.tokens
        self._evict()
        self.prompts[prompt_id] = None
        if len(self.prompts) > 64:
            self.prompts.pop(next(iter(self.prompts)))
        self._retime()

    def _retime(self) -> None:
        if self.n:
            avg_ctx = self.s / self.n + self.v
            self.step = self.cm.decode_step_s(self.n, avg_ctx, self.tp)
        self.gen += 1

    def next_event(self) -> float | None:
        """Simulated time when the next sequence finishes its turn, or None when idle."""
        if not self.n:
            return None
        return max(self.resume, self.t) + max(0.0, self.heap[0][0] - self.v) * self.step

    def pop_done(self, now: float) -> list[Request]:
        """Sequences whose turn ended; their context stays in the prefix cache for the next turn."""
        self.advance(now)
        done = []
        while self.heap and self.heap[0][0] <= self.v + 1e-6:
            _, _, req = heapq.heappop(self.heap)
            self._release(req)
            self.cache[req.traj_id] = req.context + req.tokens
            self.cached_tokens += req.context + req.tokens
            done.append(req)
        if not self.n:
            self.s = 0.0
        self._evict()
        self._retime()
        return done

    def _release(self, req: Request) -> None:
        self.n -= 1
        self.s -= req.context - req.start_v
        self.kv_used -= req.context + req.tokens

    def abort(self, now: float, traj_ids: set[str]) -> list[Request]:
        """Remove running sequences of trajectories that will never be trained (and their cache)."""
        self.advance(now)
        gone = [item for item in self.heap if item[2].traj_id in traj_ids]
        for tid in traj_ids:
            self.forget(tid)
        if not gone:
            return []
        self.heap = [item for item in self.heap if item[2].traj_id not in traj_ids]
        heapq.heapify(self.heap)
        for _, _, req in gone:
            self._release(req)
        if not self.n:
            self.s = 0.0
        self._retime()
        return [req for _, _, req in gone]

    def load_weights(self, now: float, seconds: float, version: int) -> float:
        """Swap in new weights: cached blocks are dropped and running sequences re-prefill their
        context under the new weights. Returns the re-prefill seconds."""
        self.advance(now)
        self.drop_cache()
        self.version = version
        reprefill = sum(
            self.cm.prefill_s(int(req.context + self.v - req.start_v), 0, self.tp) for _, _, req in self.heap
        )
        self.stall(now, seconds, sync=True)
        self.stall(now, reprefill)
        self.gen += 1
        return reprefill

    def reprefill_tokens(self) -> int:
        return int(self.s + self.n * self.v) if self.n else 0
