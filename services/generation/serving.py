"""Serving turns over NATS: what any process that answers `turn.request.<worker_id>` runs.

`TurnServer` validates each turn request against the contract and the model, queues it on the
continuous-batching engine, answers every accepted request with exactly one TurnResult (an error
result included, so a scheduler never hangs on it), hands back what it holds when it is drained
(running turns with the tokens they have so far), and reports its load. Where it serves (its
bucket, its TP) and whether it may (its lease) are its owner's: the rollout-engine service
(`services/rollout_engine/service.py`) today, which adds the weight-sync server, the plan and the
hybrid training side around it.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import MAX_ALTERNATIVES, MAX_TEMPERATURE, ev
from services.common.errors import LibraError, Unavailable, require
from services.common.held_context import ContextUnknown, HeldContexts
from services.common.logging import get_logger
from services.common.metrics import engine_metrics
from services.common.runconfig import EngineJob
from services.common.tracing import tracer
from services.generation.backends.base import Backend, Engine, EngineClosed, Finished, GenOutput, GenRequest
from services.generation.config import EngineSettings
from services.generation.engine import engine_for
from services.generation.speculator import counters as spec_counters

ANSWERED_REPORTED = 128
"""Answered requests a load report names (EngineLoad.answered_ids)."""
MAX_STOPS = 16
MAX_STOP_CHARS = 256


def validate_turn(
    req: ev.TurnRequest, backend: Backend, max_new_tokens_cap: int, held: HeldContexts | None = None
) -> GenRequest:
    """Checks a turn request against the contract and the model; raises InvalidMessage if it breaks
    either, ContextUnknown for a context delta over tokens `held` does not have. Generation is
    clipped so context plus output fits the model's positions."""
    require(bool(req.request_id), "request_id is empty")
    require(bool(req.trajectory_id), "trajectory_id is empty")
    require(req.context_offset >= 0, f"context_offset must be >= 0, got {req.context_offset}")
    ctx = list(req.context_token_ids)
    require(len(ctx) > 0, "context_token_ids is empty")
    if req.context_offset:
        if held is None:
            raise ContextUnknown("this engine keeps no contexts")
        ctx = held.rebuild(req.trajectory_id, req.context_offset, ctx, req.context_digest)
    require(
        0 < req.max_new_tokens <= max_new_tokens_cap,
        f"max_new_tokens must be in 1..{max_new_tokens_cap}, got {req.max_new_tokens}",
    )
    require(
        math.isfinite(req.temperature) and 0.0 <= req.temperature <= MAX_TEMPERATURE,
        f"temperature must be in 0..{MAX_TEMPERATURE}, got {req.temperature}",
    )
    vocab = backend.vocab_size
    require(all(0 <= t < vocab for t in ctx), f"context token ids must be in 0..{vocab - 1}")
    require(
        len(ctx) < backend.max_positions,
        f"context of {len(ctx)} tokens does not fit the model's {backend.max_positions} positions",
    )
    require(
        len(req.stop) <= MAX_STOPS and all(len(s) <= MAX_STOP_CHARS for s in req.stop),
        f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters",
    )
    require(math.isfinite(req.top_p) and 0.0 <= req.top_p <= 1.0, f"top_p must be in 0..1, got {req.top_p}")
    require(
        0 <= req.alternatives <= MAX_ALTERNATIVES,
        f"alternatives must be in 0..{MAX_ALTERNATIVES}, got {req.alternatives}",
    )
    require(
        0 <= req.alternatives_prompt <= len(ctx),
        f"alternatives_prompt must be in 0..{len(ctx)} (the context), got {req.alternatives_prompt}",
    )
    budget = min(req.max_new_tokens, backend.max_positions - len(ctx))
    require(req.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {req.min_new_tokens}")
    return GenRequest(
        ctx,
        budget,
        float(req.temperature),
        list(req.stop),
        int(req.priority),
        min(req.min_new_tokens, budget),
        float(req.top_p) if req.top_p > 0 else 1.0,  # unset (0): the full distribution
        req.prompt_id,
        req.group_id,
        seed=int(req.sampling_seed) if req.HasField("sampling_seed") else None,
    )


def turn_result(
    req: ev.TurnRequest, done: Finished, engine_id: str, context: int, queue_s: float
) -> ev.TurnResult:
    """What the engine answers for a turn it generated (the text decoded by the caller)."""
    out = done.output
    return ev.TurnResult(
        request_id=req.request_id,
        trajectory_id=req.trajectory_id,
        turn_index=req.turn_index,
        engine_id=engine_id,
        token_ids=out.token_ids,
        logprobs=out.logprobs,
        policy_version=done.policy_version,
        token_versions=out.token_versions,
        temperature=float(req.temperature) if req.temperature > 0 else 1.0,
        finish_reason=out.finish_reason,
        context_tokens=context,
        queue_s=queue_s,
        generate_s=done.generate_s,
        drafted_tokens=out.drafted,
        accepted_tokens=out.accepted,
    )


def alternative_requests(req: ev.TurnRequest, gen: GenRequest, max_positions: int) -> list[GenRequest]:
    """The turn's further samples (TurnRequest.alternatives): from its prompt (the context's first
    `alternatives_prompt` tokens), with the budget the turn had before it kept any tokens, each with
    a seed of its own (the turn's plus its index, where the turn has one), never streamed."""
    prompt = gen.prompt_ids[: req.alternatives_prompt or len(gen.prompt_ids)]
    kept = len(gen.prompt_ids) - len(prompt)
    budget = min(gen.max_new_tokens + kept, max_positions - len(prompt))
    return [
        dataclasses.replace(
            gen,
            prompt_ids=list(prompt),
            max_new_tokens=budget,
            min_new_tokens=min(gen.min_new_tokens + kept, budget),
            seed=None if gen.seed is None else (gen.seed + i) % (1 << 64),
            on_tokens=None,
        )
        for i in range(1, req.alternatives + 1)
    ]


async def generate(
    engine: Engine, gen: GenRequest, others: list[GenRequest]
) -> tuple[Finished, list[Finished]]:
    """The turn and its alternatives, sampled side by side; if one fails, the rest are given up."""
    tasks = [asyncio.ensure_future(engine.submit(o)) for o in others]
    try:
        done = await engine.submit(gen)
        return done, list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()


def add_alternatives(
    result: ev.TurnResult, others: list[Finished], decode: Callable[[list[int]], str]
) -> bool:
    """The alternatives into the turn's result; False if one was handed back unfinished (an engine
    draining): the turn then goes again whole, its alternatives with it."""
    if any(o.output.finish_reason == "handed_back" for o in others):
        return False
    result.alternatives.extend(
        ev.Alternative(
            token_ids=o.output.token_ids,
            logprobs=o.output.logprobs,
            token_versions=o.output.token_versions,
            finish_reason=o.output.finish_reason,
            text=decode(o.output.token_ids),
        )
        for o in others
    )
    return True


def error_result(req: ev.TurnRequest, engine_id: str, version: int, code: str, message: str) -> ev.TurnResult:
    """What the engine answers for a turn it did not generate: a typed error, no tokens."""
    return ev.TurnResult(
        request_id=req.request_id,
        trajectory_id=req.trajectory_id,
        turn_index=req.turn_index,
        engine_id=engine_id,
        policy_version=version,
        finish_reason="error",
        context_tokens=req.context_offset + len(req.context_token_ids),
        error=ev.ErrorInfo(code=code, message=message[:500]),
    )


def count_turn(prom: Any, span: trace.Span, out: GenOutput, version: int) -> None:
    """A generated turn in the engine's metrics and its span."""
    span.set_attribute("libra.policy_version", version)
    span.set_attribute("libra.new_tokens", len(out.token_ids))
    prom.turns.labels(out.finish_reason or "unknown").inc()
    prom.tokens.inc(len(out.token_ids))
    if out.drafted:
        span.set_attribute("libra.spec.drafted_tokens", out.drafted)
        span.set_attribute("libra.spec.accepted_tokens", out.accepted)
        prom.drafted.inc(out.drafted)
        prom.accepted.inc(out.accepted)


class TurnStream:
    """A streamed turn's tokens as they are sampled (`TurnRequest.stream`), spoken as TurnProgress
    at most every `interval_s`: the engine's callback only appends (it must not block), a timer
    publishes what gathered since. Best effort: the TurnResult carries the whole turn anyway."""

    def __init__(self, bus: Bus, req: ev.TurnRequest, engine_id: str, interval_s: float):
        self.bus, self.req, self.engine_id, self.interval_s = bus, req, engine_id, interval_s
        self.sent = 0
        self.waiting: list[int] = []
        self.timer: asyncio.TimerHandle | None = None
        self.publishing: set[asyncio.Task[None]] = set()
        self.closed = False

    def add(self, token_ids: list[int]) -> None:
        if self.closed:
            return
        self.waiting += token_ids
        if self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.interval_s, self._flush)

    def _flush(self) -> None:
        self.timer = None
        if self.closed or not self.waiting:
            return
        msg = ev.TurnProgress(
            request_id=self.req.request_id,
            trajectory_id=self.req.trajectory_id,
            engine_id=self.engine_id,
            offset=self.sent,
            token_ids=self.waiting,
        )
        self.sent += len(self.waiting)
        self.waiting = []
        task = asyncio.create_task(self.bus.publish(subjects.TURN_PROGRESS, msg))
        self.publishing.add(task)
        task.add_done_callback(self.publishing.discard)

    def close(self) -> None:
        """The turn ended: nothing more goes out (its result says the rest)."""
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class TurnServer(abc.ABC):
    """Turn requests in, turn results and load reports out, for one worker id on one backend.
    Its owner connects `bus`, then calls `open_turns` once the worker may serve, and
    `close_turns` when it stops."""

    bus: Bus

    def __init__(
        self, worker_id: str, settings: EngineSettings, job: EngineJob, backend: Backend, service: str
    ):
        self.worker_id = worker_id
        self.settings = settings
        self.service = service
        """The service kind its metrics are published as."""
        self.max_new_tokens_cap = max(settings.max_new_tokens_cap, job.max_new_tokens)
        """A turn may ask for the job's whole output budget (task.max_new_tokens), at least: the
        setting protects against more than the job asks for, not against the job itself."""
        self.log = get_logger(component="service")
        self.prom = engine_metrics()
        self.backend = backend
        self.engine = engine_for(backend, job.rollout.max_batch, job.rollout.speculative)
        self.weight_sync_addr = ""
        """Where its weights are pushed (load reports say so); empty if they are not pushed to it."""
        self.held = 0
        self.stopping = False
        self._turns: set[asyncio.Task[None]] = set()
        self._sub: Any = None
        self.holding: set[str] = set()
        self._serving: dict[str, tuple[asyncio.Task[None], ev.TurnRequest]] = {}
        """Turns queued or running here, by request id: what a drain hands back."""
        self.draining = False
        self._awaiting_weights: set[str] = set()
        """Turns it holds that wait for newer weights, or for its GPUs to switch to rollout (not in
        the engine yet: none has a token)."""
        self.last_seq = 0
        """The highest TurnRequest.seq it has read (its load reports say so)."""
        self.answered: deque[str] = deque(maxlen=ANSWERED_REPORTED)
        """The requests it answered last (its load reports name them)."""
        self._awake_at = 0.0
        """Lent by the trainer, or restarted at another TP: turns start once its GPUs have switched
        (monotonic)."""
        self.served_any = False
        """Whether it took a turn yet (a TP change before that costs nothing)."""
        self.turns_answered = 0
        """Turns it answered with what it generated (not refusals or errors)."""
        self.load_reports = 0
        """EngineLoad reports published (on a change of routing state, or a heartbeat)."""
        self.contexts = HeldContexts(settings.held_context_tokens)
        """Each trajectory's context after its last turn here: the next one comes as a delta."""

    @property
    @abc.abstractmethod
    def bucket(self) -> str:
        """The bucket it serves now (its load reports say so)."""

    @property
    def tensor_parallel(self) -> int:
        """The GPUs it spans (its load reports say so)."""
        return 1

    @abc.abstractmethod
    def holds_lease(self) -> bool:
        """Whether it still holds the lease it serves under (one that lost it may have been
        replaced: it takes no turn)."""

    async def open_turns(self) -> None:
        """Serves `turn.request.<worker_id>` from now on and reports its load."""
        self._sub = await self.bus.subscribe(
            f"{subjects.TURN_REQUEST}.{self.worker_id}", ev.TurnRequest, self._on_turn
        )
        self.bus.spawn(self._load_loop())

    async def close_turns(self, grace_s: float) -> None:
        """Stops intake, finishes the running batch and hands queued requests back."""
        self.stopping = True
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        await self.engine.close(timeout=grace_s / 3)
        if self._turns:
            await asyncio.wait(set(self._turns), timeout=grace_s / 4)

    async def _drain(self) -> int:
        """The planner took this engine out of rollout (maintenance, a move to another bucket or to
        training): it refuses new turns and hands back every turn it holds, queued or running,
        with `handed_back` at once, so the scheduler continues them elsewhere instead of waiting
        for them. A running turn comes back with the tokens it generated so far (their logprobs
        and versions), which the scheduler keeps: the turn goes on from there on another engine,
        which re-prefills the context (vllm too: it aborts them in vLLM and answers with what they
        streamed)."""
        if self.draining:
            return 0
        self.draining = True
        held = list(self._serving.values())
        hand_back = getattr(self.engine, "hand_back", None)
        kept = await hand_back() if hand_back is not None else 0  # their tasks publish them
        await asyncio.sleep(0)
        for task, req in held:
            if task.done() or (hand_back is not None and req.request_id not in self._awaiting_weights):
                continue
            task.cancel()  # waiting for weights, or a backend without hand_back: no tokens
            await self._publish_error(req, "handed_back", f"{self.worker_id} is draining", None)
        self.log.info("engine_drained", handed_back=len(held), with_tokens=kept)
        return len(held)

    async def _on_turn(self, req: ev.TurnRequest, env: Envelope) -> None:
        """Validates and queues; generation runs in its own task so this subscription stays free."""
        received = time.monotonic()
        self.last_seq = max(self.last_seq, req.seq)
        try:
            if self.stopping:
                raise Unavailable("shutdown")
            if self.draining:
                raise Unavailable("draining: this engine was taken out of rollout by the planner")
            if not self.holds_lease():  # it may have been replaced: it does not act
                raise Unavailable("lease_lost: this engine's lease was not renewed; it waits for a new one")
            gen = validate_turn(req, self.backend, self.max_new_tokens_cap, self.contexts)
        except LibraError as err:
            if req.request_id:
                await self._publish_error(req, err.code, str(err), env.context)
            raise
        self.served_any = True
        task = asyncio.create_task(self._serve_turn(req, gen, env.context, received))
        self._turns.add(task)
        self.holding.add(req.request_id)
        self._serving[req.request_id] = (task, req)
        task.add_done_callback(self._turns.discard)
        task.add_done_callback(lambda _: self.holding.discard(req.request_id))
        task.add_done_callback(lambda _: self._serving.pop(req.request_id, None))

    async def _serve_turn(
        self, req: ev.TurnRequest, gen: GenRequest, parent: otel_context.Context, received: float
    ) -> None:
        log = self.log.bind(trajectory_id=req.trajectory_id, request_id=req.request_id)
        with tracer().start_as_current_span("engine.generate", context=parent) as span:
            span.set_attribute("libra.trajectory_id", req.trajectory_id)
            span.set_attribute("libra.context_tokens", len(gen.prompt_ids))
            span.set_attribute("libra.context_offset", req.context_offset)  # tokens it held already
            ctx = otel_context.get_current()
            streamed: TurnStream | None = None
            try:
                if self.draining:  # taken away before it started: nothing generated
                    await self._publish_error(req, "handed_back", f"{self.worker_id} is draining", ctx)
                    return
                waking = self._awake_at - time.monotonic()
                if waking > 0 or self.engine.version < req.min_policy_version:
                    self.held += 1
                    self._awaiting_weights.add(req.request_id)
                    try:
                        if waking > 0:
                            await asyncio.sleep(waking)
                        ok = await self.engine.wait_for_version(
                            req.min_policy_version, self.settings.max_wait_for_weights_s
                        )
                    finally:
                        self.held -= 1
                        self._awaiting_weights.discard(req.request_id)
                    if not ok:
                        stale = (
                            f"weights v{self.engine.version} < min_policy_version {req.min_policy_version}"
                        )
                        await self._publish_error(
                            req, "unavailable", "shutdown" if self.stopping else stale, ctx
                        )
                        return
                if self.draining:  # taken away while it waited for weights: nothing generated
                    await self._publish_error(req, "handed_back", f"{self.worker_id} is draining", ctx)
                    return
                if req.stream:
                    streamed = TurnStream(self.bus, req, self.worker_id, self.settings.stream_interval_s)
                    gen.on_tokens = streamed.add
                try:
                    others = alternative_requests(req, gen, self.backend.max_positions)
                    done, alternatives = await generate(self.engine, gen, others)
                finally:
                    if streamed is not None:
                        streamed.close()
            except EngineClosed:
                await self._publish_error(req, "unavailable", "shutdown", ctx)
                return
            except LibraError as err:  # the backend refused this request: the engine serves on
                log.warning("turn_refused", code=err.code, error=str(err))
                await self._publish_error(req, err.code, str(err), ctx)
                return
            except Exception as err:
                log.exception("generate_failed")
                span.set_status(trace.StatusCode.ERROR, str(err))
                await self._publish_error(req, "internal", f"{type(err).__name__}: {err}", ctx)
                return
            out = done.output
            queue_s = max(0.0, time.monotonic() - received - done.generate_s)
            _span_ago("engine.queue", ctx, queue_s + done.generate_s, queue_s)
            result = turn_result(req, done, self.worker_id, len(gen.prompt_ids), queue_s)
            result.text = self.backend.decode(out.token_ids)
            draining = f"{self.worker_id} is draining"
            if out.finish_reason == "handed_back":  # drained mid-turn: what it made so far
                result.error.CopyFrom(ev.ErrorInfo(code="handed_back", message=draining))
            elif not add_alternatives(result, alternatives, self.backend.decode):  # all of it again
                result = error_result(req, self.worker_id, done.policy_version, "handed_back", draining)
            if result.HasField("error"):
                self.contexts.forget(req.trajectory_id)
            else:
                self.contexts.keep(req.trajectory_id, [*gen.prompt_ids, *out.token_ids])
            await self.bus.publish(subjects.TURN_RESULT, result, ctx=ctx)
            self.answered.append(req.request_id)
            self.turns_answered += 1
            count_turn(self.prom, span, out, done.policy_version)
            self.prom.tokens.inc(sum(len(a.token_ids) for a in result.alternatives))
            log.debug("turn_done", tokens=len(out.token_ids), policy_version=done.policy_version)

    async def _publish_error(
        self, req: ev.TurnRequest, code: str, message: str, ctx: otel_context.Context | None
    ) -> None:
        result = error_result(req, self.worker_id, self.engine.version, code, message)
        with contextlib.suppress(Exception):
            await self.bus.publish(subjects.TURN_RESULT, result, ctx=ctx)
            self.answered.append(req.request_id)

    def load_report(self, tokens_per_s: float) -> ev.EngineLoad:
        load = ev.EngineLoad(
            engine_id=self.worker_id,
            bucket=self.bucket,
            running=self.engine.running,
            waiting=self.engine.waiting + self.held,
            tokens_per_s=tokens_per_s,
            weight_version=self.engine.version,
            weight_sync_addr=self.weight_sync_addr,
            request_ids=sorted(self.holding),
            last_seq=self.last_seq,
            answered_ids=list(self.answered),
            tensor_parallel=self.tensor_parallel,
            capacity_seqs=self.engine.max_batch,
            free_kv_tokens=self.backend.free_kv_tokens(),
            backend=self.backend.name,
        )
        if (c := spec_counters(self.engine)) is not None:
            load.spec_verify_steps, load.spec_drafted_tokens, load.spec_accepted_tokens = (
                c.verify_steps,
                c.drafted,
                c.accepted,
            )
        m = self.prom
        m.running.set(load.running)
        m.waiting.set(load.waiting)
        m.tokens_per_s.set(tokens_per_s)
        m.weight_version.set(load.weight_version)
        m.free_kv_tokens.set(load.free_kv_tokens)
        return load

    def _routing_state(self) -> tuple[object, ...]:
        """What the scheduler routes and reconciles by, cheaply: a load report goes out when it
        changes. A decoding engine's KV use grows without it changing; the heartbeat covers that."""
        e = self.engine
        return (
            e.running,
            e.waiting + self.held,
            len(self.holding),
            self.last_seq,
            self.answered[-1] if self.answered else None,
            e.version,
            self.bucket,
            e.max_batch,
        )

    async def _load_loop(self) -> None:
        """Every `load_report_interval_s` a look at the routing state; an EngineLoad and a
        MetricSample when it changed or `load_heartbeat_s` after the last ones. An engine idle or
        decoding steadily says so every few seconds, not every second: at 1,024 engines those are
        most of the bus's messages. Its last turn answered changes the state, so what a job's
        report reads from the last sample (tokens generated) is complete."""
        s = self.settings
        last_t, last_tokens = time.monotonic(), self.engine.tokens_generated
        reported: tuple[object, ...] | None = None
        while True:
            await asyncio.sleep(s.load_report_interval_s)
            now, state = time.monotonic(), self._routing_state()
            if state == reported and now - last_t < s.load_heartbeat_s:
                continue
            tokens = self.engine.tokens_generated
            rate = (tokens - last_tokens) / max(now - last_t, 1e-9)
            last_t, last_tokens, reported = now, tokens, state
            with contextlib.suppress(Exception):
                await self.bus.publish(subjects.ENGINE_LOAD, self.load_report(rate))
                self.load_reports += 1
                await self.bus.publish(subjects.METRICS, metric_sample(self, rate))


def metric_sample(server: TurnServer, tokens_per_s: float) -> ev.MetricSample:
    """An engine's load report plus what EngineLoad has no field for, above all whether it is emulated."""
    engine = server.engine
    values = {
        "emulated": float(server.backend.emulated),
        "running": float(engine.running),
        "waiting": float(engine.waiting + server.held),
        "tokens_per_s": tokens_per_s,
        "tokens_total": float(engine.tokens_generated),
        "weight_version": float(engine.version),
        "rejected": float(server.bus.rejected),
        "load_reports": float(server.load_reports),
    }
    if (c := spec_counters(engine)) is not None:
        values.update(c.values())
        server.prom.acceptance.set(c.acceptance_rate)
    if (hit_rate := getattr(server.backend, "prefix_hit_rate", None)) is not None:
        values["prefix_cache_hit_rate"] = float(hit_rate)  # vllm: prompt tokens found cached
    return ev.MetricSample(service=server.service, worker_id=server.worker_id, values=values)


def _span_ago(name: str, ctx: otel_context.Context, began_s_ago: float, duration_s: float) -> None:
    """Records a span that began `began_s_ago` seconds ago and lasted `duration_s` (measured on the
    monotonic clock, placed on the wall clock the spans use)."""
    now = time.time_ns()
    start = now - int(began_s_ago * 1e9)
    tracer().start_span(name, context=ctx, start_time=start).end(end_time=start + int(duration_s * 1e9))
