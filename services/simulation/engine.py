"""One rollout replica under continuous batching, simulated without an event per token.

Every running sequence advances one decode iteration at a time, so the engine keeps a virtual
token clock `v`: a sequence that joins at `v0` needing `n` tokens finishes at `v0 + n`. Between
membership changes the iteration time is constant, so an engine only wakes when a sequence
finishes or another joins. Prefill and weight loading stall decoding (`resume`).

Speculative decoding: sequences whose drafter has the same per-token acceptance share a *lane*
with its own token clock, which advances by the lane's expected tokens per verify step
(`services.policy.speculation.expected_tokens` at the draft length the engine's policy
chose); the step time prices every verified token (`CostModel.verify_step_s`). Without
speculation there is one lane advancing one token per step.

KV cache, as vLLM manages it: a running sequence holds its context plus the tokens it may still
generate; when its turn ends the blocks stay in the prefix cache (evictable, least recently used
first) while the trajectory waits for its tool, so the next turn on the same engine prefills only
the tool return. A weight update invalidates every cached block (vLLM resets the prefix cache) and,
for running sequences, the KV computed with the old weights: they re-prefill their context
(interruptible generation, as in AReaL) unless the engine drained first.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.common.cost_model import CostModel
from services.policy.dispatch import kv_fits
from services.policy.speculation import Lane, SpeculationPolicy, expected_tokens

BAND = 1.5
"""Factor by which batch size or mean context must move for the speculation policy to decide again."""


@dataclass(slots=True)
class Request:
    traj_id: str
    tokens: int
    context: int
    """Context at the start of decoding (after prefill)."""
    start_v: float = 0.0
    acceptance: float = 0.0
    """Per-token acceptance of this turn's drafter (0: no draft, plain decoding)."""


class _Lane:
    """Running sequences sharing one drafter acceptance, on one token clock."""

    __slots__ = ("acceptance", "draft", "heap", "n", "rate", "s", "theta", "v")

    def __init__(self, acceptance: float) -> None:
        self.acceptance = acceptance
        self.heap: list[tuple[float, int, Request]] = []
        self.n = 0
        self.s = 0.0
        """Sum over running sequences of context at join minus the clock at join."""
        self.v = 0.0
        self.rate = 1.0
        """Expected tokens per verify step at the current draft length."""
        self.draft = 0
        self.theta = -1.0
        """The policy threshold `draft` and `rate` were set for."""


class PrefixCache:
    """What an engine keeps of paused trajectories' contexts (their blocks stay while they wait in a
    tool; the least recently used go first when running turns need the KV) and the prompts it saw
    lately (a group's siblings find their shared prompt)."""

    __slots__ = ("entries", "prompts", "tokens")

    def __init__(self) -> None:
        self.entries: OrderedDict[str, int] = OrderedDict()
        """Trajectories paused in a tool whose context is still cached -> tokens."""
        self.tokens = 0
        self.prompts: dict[str, None] = {}

    def keep(self, traj_id: str, tokens: int) -> None:
        self.entries[traj_id] = tokens
        self.tokens += tokens

    def take(self, traj_id: str) -> bool:
        """Claim a paused trajectory's cached context (True) or report that it was evicted."""
        tokens = self.entries.pop(traj_id, None)
        if tokens is None:
            return False
        self.tokens -= tokens
        return True

    def forget(self, traj_id: str) -> None:
        self.take(traj_id)

    def clear(self) -> None:
        """Forget every cached prefix (new weights, or the GPU leaves rollout)."""
        self.entries.clear()
        self.tokens = 0
        self.prompts.clear()

    def evict(self, room: int) -> None:
        """Drops the least recently used contexts until the cache fits in `room` tokens."""
        while self.entries and self.tokens > room:
            _, tokens = self.entries.popitem(last=False)
            self.tokens -= tokens

    def saw_prompt(self, prompt_id: str) -> None:
        self.prompts[prompt_id] = None
        if len(self.prompts) > 64:
            self.prompts.pop(next(iter(self.prompts)))


class Drafting:
    """An engine's speculation policy at work: the draft length of each lane, decided again when
    the batch size or its mean context moved by more than `BAND` since the last decision, as
    engines tune draft lengths per batch-size bucket (TLT; vLLM's
    num_speculative_tokens_per_batch_size); the step is priced exactly anyway."""

    __slots__ = ("band", "policy", "threshold")

    def __init__(self, policy: SpeculationPolicy) -> None:
        self.policy = policy
        self.band = (0.0, 0.0)
        """Batch size and mean context at the last decision."""
        self.threshold = 0.0
        """The policy's last decision (`SpeculationPolicy.threshold`)."""

    def choose(self, lanes: list[_Lane], n: int, avg_ctx: float, cm: CostModel, tp: int) -> tuple[int, float]:
        """Sets each lane's draft length and rate; returns the batch's drafted tokens per verify
        step and the tokens expected to be accepted of them (`cm` prices a verify step of a TP-`tp`
        engine when the policy decides again)."""
        n0, ctx0 = self.band
        if not (n0 / BAND <= n <= n0 * BAND and ctx0 / BAND <= avg_ctx <= ctx0 * BAND):
            self.band = (n, avg_ctx)
            cost = cm.verify_cost(n, avg_ctx, tp)
            self.threshold = self.policy.threshold([Lane(ln.n, ln.acceptance) for ln in lanes], cost)
        theta = self.threshold
        drafted, accept = 0, 0.0
        for ln in lanes:
            if ln.theta != theta:
                ln.theta = theta
                ln.draft = self.policy.draft_length(ln.acceptance, theta)
                ln.rate = expected_tokens(ln.acceptance, ln.draft)
            drafted += ln.n * ln.draft
            accept += ln.n * (ln.rate - 1.0)
        return drafted, accept


class Engine:
    __slots__ = (
        "_accepting",
        "loaded",
        "bucket",
        "busy_s",
        "cm",
        "engine_id",
        "drafted",
        "accepted",
        "accept_sum",
        "draft_sum",
        "drafting",
        "gen",
        "hybrid",
        "kv_capacity",
        "kv_used",
        "lanes",
        "max_seqs",
        "n",
        "open_since",
        "opened_s",
        "pace",
        "prefix",
        "resume",
        "seq",
        "seq_iters",
        "spec",
        "stale",
        "step_s",
        "sync_s",
        "t",
        "tp",
        "version",
    )

    def __init__(
        self,
        engine_id: str,
        bucket: str,
        tp: int,
        cm: CostModel,
        max_seqs: int,
        hybrid: bool = False,
        spec: SpeculationPolicy | None = None,
    ):
        self.engine_id = engine_id
        self.bucket = bucket
        self.tp = tp
        self.cm = cm
        self.max_seqs = max_seqs
        self.kv_capacity = cm.kv_capacity_tokens(tp)
        self.kv_used = 0
        self.hybrid = hybrid
        self.loaded: Callable[[Engine], None] | None = None
        """Told when the engine's running turns change, or whether it is open and accepting turns
        (its routing key's load index)."""
        self._accepting = True
        self.spec = spec if spec is not None and spec.enabled else None
        self.drafting = Drafting(self.spec) if self.spec is not None else None
        self.lanes: dict[float, _Lane] = {}
        self.n = 0
        self.t = 0.0
        self.resume = 0.0
        self.step_s = 0.0
        self.stale = False
        """Membership changed since `step_s` was priced (priced lazily: a burst of joins at one
        instant prices the batch once)."""
        self.pace = 1.0
        """Its iterations' cost over their cost alone (engines sharing a host: `set_pace`)."""
        self.seq = 0
        self.gen = 0
        self.busy_s = 0.0
        self.sync_s = 0.0
        self.opened_s = 0.0
        self.open_since: float | None = None
        self.prefix = PrefixCache()
        self.version = 0
        """Weight version this engine serves."""
        self.seq_iters = 0.0
        """Sum over decode iterations of the sequences in the batch (verify steps taken)."""
        self.drafted = 0.0
        """Drafted tokens verified (expected counts, summed over decode iterations)."""
        self.accepted = 0.0
        """Drafted tokens accepted."""
        self.draft_sum = 0
        """Drafted tokens verified per decode iteration by the whole batch (at the last pricing)."""
        self.accept_sum = 0.0
        """Drafted tokens expected to be accepted per decode iteration."""

    @property
    def accepting(self) -> bool:
        """False while the engine finishes its turns before leaving rollout (a hybrid worker)."""
        return self._accepting

    @accepting.setter
    def accepting(self, value: bool) -> None:
        self._accepting = value
        if self.loaded is not None:
            self.loaded(self)

    def open(self, now: float) -> None:
        self.t = max(self.t, now)
        self.resume = max(self.resume, now)
        self.open_since = now
        if self.loaded is not None:
            self.loaded(self)

    def close(self, now: float) -> None:
        self.advance(now)
        if self.open_since is not None:
            self.opened_s += now - self.open_since
        self.open_since = None
        if self.loaded is not None:
            self.loaded(self)

    def free_kv(self) -> int:
        return max(0, self.kv_capacity - self.kv_used)

    def fits(self, context: int, reserve: int) -> bool:
        return self.n < self.max_seqs and kv_fits(self.free_kv(), context + reserve)

    def advance(self, now: float) -> None:
        if now <= self.t:
            return
        stall_end = min(now, self.resume)
        if stall_end > self.t:
            self.busy_s += stall_end - self.t
        start = max(self.t, self.resume)
        if now > start and self.n:
            self.busy_s += now - start
            iters = (now - start) / self.step
            self.seq_iters += iters * self.n
            for lane in self.lanes.values():
                lane.v += iters * lane.rate
            if self.spec is not None:
                self.drafted += iters * self.draft_sum
                self.accepted += iters * self.accept_sum
        self.t = now

    def set_pace(self, now: float, pace: float) -> None:
        """From `now` on, iterations cost `pace` times their cost alone (what ran before is kept)."""
        self.advance(now)
        self.pace = pace
        self._retime()

    def stall(self, now: float, seconds: float, sync: bool = False) -> None:
        self.advance(now)
        self.resume = max(self.resume, now) + seconds
        if sync:
            self.sync_s += seconds

    def drop_cache(self) -> None:
        self.prefix.clear()

    def join(self, req: Request, now: float, prefill_tokens: int, prompt_id: str) -> None:
        self.advance(now)
        self.resume = max(self.resume, now) + self.pace * self.cm.prefill_s(
            prefill_tokens, req.context - prefill_tokens, self.tp
        )
        key = round(req.acceptance, 3) if self.spec is not None else 0.0
        req.acceptance = key
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = _Lane(key)
        req.start_v = lane.v
        self.seq += 1
        heapq.heappush(lane.heap, (lane.v + req.tokens, self.seq, req))
        lane.n += 1
        lane.s += req.context - lane.v
        self.n += 1
        if self.loaded is not None:
            self.loaded(self)
        self.kv_used += req.context + req.tokens
        if (prefix := self.prefix).tokens > self.kv_capacity - self.kv_used:
            prefix.evict(self.kv_capacity - self.kv_used)
        self.prefix.saw_prompt(prompt_id)
        self._retime()

    def _retime(self) -> None:
        self.stale = True
        self.gen += 1

    @property
    def step(self) -> float:
        """Seconds of one decode (verify) iteration of the current batch."""
        if self.stale:
            self.stale = False
            self._price()
        return self.step_s

    def _price(self) -> None:
        if not self.n:
            return
        lanes = list(self.lanes.values())
        n = self.n
        total = 0.0
        query = n
        for ln in lanes:
            total += ln.s + ln.n * ln.v
        avg_ctx = total / n
        if self.drafting is None:
            self.step_s = self.pace * self.cm.decode_step_s(n, avg_ctx, self.tp)
            return
        drafted, self.accept_sum = self.drafting.choose(lanes, n, avg_ctx, self.cm, self.tp)
        query += drafted
        self.draft_sum = drafted
        self.step_s = self.pace * self.cm.verify_step_s(n, avg_ctx, self.tp, query)

    def next_event(self) -> float | None:
        """Simulated time when the next sequence finishes its turn, or None when idle."""
        if not self.n:
            return None
        step = self.step
        iters = math.inf
        for ln in self.lanes.values():  # empty lanes are removed
            x = (ln.heap[0][0] - ln.v) / ln.rate
            if x < iters:
                iters = x
        return max(self.resume, self.t) + max(0.0, iters) * step

    def running(self) -> list[tuple[Request, float]]:
        """Running sequences with the tokens each has generated in its current turn so far."""
        return [(req, ln.v - req.start_v) for ln in self.lanes.values() for _, _, req in ln.heap]

    def pop_done(self, now: float) -> list[Request]:
        """Sequences whose turn ended; their context stays in the prefix cache for the next turn."""
        self.advance(now)
        done = []
        for key, lane in list(self.lanes.items()):
            while lane.heap and lane.heap[0][0] <= lane.v + 1e-6:
                _, _, req = heapq.heappop(lane.heap)
                self._release(lane, req)
                self.prefix.keep(req.traj_id, req.context + req.tokens)
                done.append(req)
            if not lane.n:
                del self.lanes[key]
        if (prefix := self.prefix).tokens > self.kv_capacity - self.kv_used:
            prefix.evict(self.kv_capacity - self.kv_used)
        self._retime()
        return done

    def _release(self, lane: _Lane, req: Request) -> None:
        self.n -= 1
        if self.loaded is not None:
            self.loaded(self)
        lane.n -= 1
        lane.s -= req.context - req.start_v
        self.kv_used -= req.context + req.tokens

    def abort(self, now: float, traj_ids: set[str]) -> list[Request]:
        """Remove running sequences of trajectories that will never be trained (and their cache)."""
        self.advance(now)
        for tid in traj_ids:
            self.prefix.forget(tid)
        gone: list[Request] = []
        for key, lane in list(self.lanes.items()):
            out = [item for item in lane.heap if item[2].traj_id in traj_ids]
            if not out:
                continue
            lane.heap = [item for item in lane.heap if item[2].traj_id not in traj_ids]
            heapq.heapify(lane.heap)
            for _, _, req in out:
                self._release(lane, req)
                gone.append(req)
            if not lane.n:
                del self.lanes[key]
        if gone:
            self._retime()
        return gone

    def detach(self, now: float, traj_id: str) -> tuple[Request, float] | None:
        """Take one running sequence off this engine (its KV leaves with it): the request and
        the tokens it generated in this turn so far."""
        self.advance(now)
        for key, lane in self.lanes.items():
            for i, item in enumerate(lane.heap):
                req = item[2]
                if req.traj_id != traj_id:
                    continue
                done = lane.v - req.start_v
                lane.heap[i] = lane.heap[-1]
                lane.heap.pop()
                heapq.heapify(lane.heap)
                self._release(lane, req)
                if not lane.n:
                    del self.lanes[key]
                self._retime()
                return req, done
        return None

    def load_weights(self, now: float, seconds: float, version: int) -> float:
        """Swap in new weights: cached blocks are dropped and running sequences re-prefill their
        context under the new weights. Returns the re-prefill seconds."""
        self.advance(now)
        self.drop_cache()
        self.version = version
        reprefill = self.pace * sum(
            self.cm.prefill_s(int(req.context + done), 0, self.tp) for req, done in self.running()
        )
        self.stall(now, seconds, sync=True)
        self.stall(now, reprefill)
        self.gen += 1
        return reprefill

    def reprefill_tokens(self) -> int:
        return int(sum(ln.s + ln.n * ln.v for ln in self.lanes.values())) if self.n else 0
