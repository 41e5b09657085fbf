"""`python -m services.rollout_engine` as a real process, on real NATS and Redis, with the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from services.common import subjects
from services.common.bus import Bus, Envelope
from services.common.contracts import ev
from services.common.held_context import context_digest
from services.common.localstack import Server
from services.common.membership import lease_resource
from services.common.ownership import OwnershipStore
from services.common.runconfig import ModelConfig, RunConfig
from services.generation.config import EngineSettings
from tests.service_process import pinned_job_env, service_process

pytestmark = pytest.mark.integration

WORKER = "engine-t1"
TRACE_ID = 0x1234567890ABCDEF1234567890ABCDEF


class Harness:
    """Plays scheduler and planner for one engine process: collects what it publishes."""

    def __init__(self, bus: Bus, worker: str = WORKER):
        self.bus = bus
        self.worker = worker
        self.metrics: list[ev.MetricSample] = []
        self.results: dict[str, tuple[ev.TurnResult, dict[str, str]]] = {}
        self.loads: list[ev.EngineLoad] = []
        self.errors: list[ev.ErrorEvent] = []
        self.progress: dict[str, list[ev.TurnProgress]] = {}
        self.hello: asyncio.Future[ev.WorkerHello] = asyncio.get_running_loop().create_future()

    async def start(self) -> None:
        async def on_result(m: ev.TurnResult, env: Envelope) -> None:
            self.results[m.request_id] = (m, env.headers)

        async def on_load(m: ev.EngineLoad, _: Envelope) -> None:
            self.loads.append(m)

        async def on_error(m: ev.ErrorEvent, _: Envelope) -> None:
            self.errors.append(m)

        async def on_hello(m: ev.WorkerHello, _: Envelope) -> None:
            if m.worker_id == self.worker and not self.hello.done():
                self.hello.set_result(m)

        await self.bus.subscribe(subjects.TURN_RESULT, ev.TurnResult, on_result)

        async def on_progress(m: ev.TurnProgress, _: Envelope) -> None:
            self.progress.setdefault(m.request_id, []).append(m)

        await self.bus.subscribe(subjects.TURN_PROGRESS, ev.TurnProgress, on_progress)
        await self.bus.subscribe(subjects.ENGINE_LOAD, ev.EngineLoad, on_load)
        await self.bus.subscribe(subjects.ERRORS, ev.ErrorEvent, on_error)

        async def on_metrics(m: ev.MetricSample, _: Envelope) -> None:
            self.metrics.append(m)

        await self.bus.subscribe(subjects.WORKER_HELLO, ev.WorkerHello, on_hello)
        await self.bus.subscribe(subjects.METRICS, ev.MetricSample, on_metrics)

    async def assign(self, store: OwnershipStore) -> ev.WorkerHello:
        """Answers the engine's hello the way the planner does: a lease and a plan naming it."""
        hello = await asyncio.wait_for(self.hello, 90)
        lease = await store.acquire(lease_resource("rollout", self.worker), self.worker, 10)
        assert lease is not None
        a = ev.Assignment(worker_id=self.worker, role="rollout", bucket="short", fencing_token=lease.token)
        plan = ev.Plan(plan_version=1, assignments=[a])
        await self.bus.publish_durable(subjects.PLAN, plan, msg_id=f"{self.bus.run_id}-plan-1")
        async with asyncio.timeout(30):
            while not self.loads:
                await asyncio.sleep(0.05)
        return hello

    async def send(self, req: ev.TurnRequest, ctx: Any = None) -> None:
        await self.bus.publish(f"{subjects.TURN_REQUEST}.{self.worker}", req, ctx=ctx)

    async def result(self, request_id: str, timeout: float = 60) -> tuple[ev.TurnResult, dict[str, str]]:
        async with asyncio.timeout(timeout):
            while request_id not in self.results:
                await asyncio.sleep(0.05)
        return self.results[request_id]

    def streamed(self, request_id: str) -> list[int]:
        """The tokens a streamed turn reported while it generated: in order, from the first."""
        got = self.progress.get(request_id, [])
        assert [m.offset for m in got] == [sum(len(p.token_ids) for p in got[:i]) for i in range(len(got))]
        assert all(m.engine_id == self.worker and m.trajectory_id == f"traj-{request_id}" for m in got)
        return [t for m in got for t in m.token_ids]


def turn(request_id: str, **kw: Any) -> ev.TurnRequest:
    base: dict[str, Any] = dict(
        request_id=request_id,
        trajectory_id=f"traj-{request_id}",
        engine_id=WORKER,
        bucket="short",
        context_token_ids=list(range(100, 140)),
        max_new_tokens=16,
        temperature=1.0,
    )
    base.update(kw)
    return ev.TurnRequest(**base)


@pytest.fixture
async def engine(
    tmp_path: Path, nats_server: Server, redis_server: Server, run_id: str, tiny_model: ModelConfig
) -> AsyncIterator[tuple[subprocess.Popen[bytes], Harness]]:
    run = {
        "model": {"source": "tiny-random", "cache_dir": tiny_model.cache_dir},
        "rollout": {"backend": "hf", "max_batch": 4},
    }
    env = pinned_job_env(
        tmp_path,
        run,
        nats_server.url,
        redis_server.url,
        run_id,
        WORKER,
        LIBRA_ROLLOUT_ENGINE_LOAD_REPORT_INTERVAL_S="0.2",
        LIBRA_ROLLOUT_ENGINE_LOAD_HEARTBEAT_S="1",
        LIBRA_ROLLOUT_ENGINE_MAX_WAIT_FOR_WEIGHTS_S="1",
        LIBRA_ROLLOUT_ENGINE_SEED="0",
        LIBRA_ROLLOUT_ENGINE_STREAM_INTERVAL_S="0",
    )
    bus = await Bus.connect(nats_server.url, run_id, "test", "harness")
    store = OwnershipStore.from_url(redis_server.url, run_id)
    harness = Harness(bus)
    await harness.start()
    try:
        with service_process("services.rollout_engine", env, tmp_path / "engine.log") as proc:
            hello = await asyncio.wait_for(harness.hello, 90)
            assert hello.kind == "rollout-engine" and hello.weight_sync_addr.startswith("127.0.0.1:")
            lease = await store.acquire(lease_resource("rollout", WORKER), WORKER, 10)
            assert lease is not None
            a = ev.Assignment(worker_id=WORKER, role="rollout", bucket="short", fencing_token=lease.token)
            plan = ev.Plan(plan_version=1, assignments=[a])
            await bus.publish_durable(subjects.PLAN, plan, msg_id=f"{run_id}-plan-1")
            async with asyncio.timeout(30):
                while not harness.loads:
                    await asyncio.sleep(0.05)
            yield proc, harness
    finally:
        await bus.close()
        await store.close()


async def test_serves_turns_refuses_bad_input_and_keeps_serving(engine: Any) -> None:
    proc, h = engine
    load = h.loads[-1]
    assert (load.engine_id, load.bucket, load.weight_version) == (WORKER, "short", 0)
    before = len(h.loads)  # idle, it reports once a heartbeat (1 s here), not every look (0.2 s)
    await asyncio.sleep(2.5)
    assert 1 <= len(h.loads) - before <= 4, len(h.loads) - before

    parent = trace.set_span_in_context(
        NonRecordingSpan(SpanContext(TRACE_ID, 0xABCDEF, is_remote=True, trace_flags=TraceFlags(1)))
    )
    ids = [f"ok-{i}" for i in range(5)]
    for i, rid in enumerate(ids):
        await h.send(turn(rid, max_new_tokens=8 + i, stop=["\n\n"]), ctx=parent)
    for i, rid in enumerate(ids):
        res, headers = await h.result(rid)
        assert not res.HasField("error"), res.error
        assert res.trajectory_id == f"traj-{rid}" and res.engine_id == WORKER
        assert 0 < len(res.token_ids) <= 8 + i and len(res.logprobs) == len(res.token_ids)
        assert all(lp <= 0 for lp in res.logprobs)
        assert res.finish_reason in ("stop", "length") and res.policy_version == 0
        assert res.context_tokens == 40 and isinstance(res.text, str)
        assert f"{TRACE_ID:032x}" in headers.get("traceparent", "")

    proc_errors = len(h.errors)
    await h.bus.nc.publish(h.bus.subject(f"{subjects.TURN_REQUEST}.{WORKER}"), b"\xff\x00garbage")
    await h.send(turn("bad-tokens", max_new_tokens=0))
    await h.send(turn("bad-vocab", context_token_ids=[1, 10**9]))
    await h.send(turn("too-new", min_policy_version=3))
    for rid, code in (("bad-tokens", "invalid"), ("bad-vocab", "invalid"), ("too-new", "unavailable")):
        res, _ = await h.result(rid)
        assert (res.finish_reason, res.error.code) == ("error", code), res.error.message
        assert not res.token_ids
    async with asyncio.timeout(10):
        while not any(e.error.code == "malformed" for e in h.errors[proc_errors:]):
            await asyncio.sleep(0.05)

    await h.send(turn("after"))
    res, _ = await h.result("after")
    assert not res.HasField("error") and len(res.token_ids) > 0
    # a streamed turn says its tokens as it samples them; its result is still the whole turn
    await h.send(turn("streamed", max_new_tokens=12, min_new_tokens=12, stream=True))
    res, _ = await h.result("streamed")
    streamed = h.streamed("streamed")
    assert 0 < len(streamed) < len(res.token_ids) == 12 and res.token_ids[: len(streamed)] == streamed
    assert not any(rid in h.progress for rid in ids), "a turn not streamed says nothing until its end"
    assert proc.poll() is None


async def test_a_turn_with_alternatives_samples_them_beside_it(engine: Any) -> None:
    """An agent's call with n = 3: the engine samples two alternatives beside the turn, each with
    a seed of its own (the same seed again: the same three). A turn continued after a hand-back
    (its context ends with the 4 tokens it kept) samples its alternatives again from its prompt,
    with the whole budget; asking for more than an engine takes is refused."""
    proc, h = engine
    ask = dict(max_new_tokens=12, min_new_tokens=12, alternatives=2, sampling_seed=5)
    samples = []
    for rid in ("alts", "alts-again"):
        await h.send(turn(rid, **ask))
        res, _ = await h.result(rid)
        assert not res.HasField("error") and len(res.alternatives) == 2, res.error
        for a in res.alternatives:
            assert len(a.token_ids) == len(a.logprobs) == len(a.token_versions) == 12
            assert (
                all(lp <= 0 for lp in a.logprobs) and a.finish_reason == "length" and isinstance(a.text, str)
            )
        samples.append([list(res.token_ids), *(list(a.token_ids) for a in res.alternatives)])
    assert samples[0] == samples[1] and len({tuple(s) for s in samples[0]}) == 3
    kept = samples[0][0][:4]
    await h.send(
        turn("continued", context_token_ids=[*range(100, 140), *kept], max_new_tokens=8, min_new_tokens=8,
             alternatives=2, alternatives_prompt=40, sampling_seed=5)
    )  # fmt: skip
    res, _ = await h.result("continued")
    assert not res.HasField("error") and len(res.token_ids) == 8
    assert kept + list(res.token_ids) == samples[0][0]  # it goes on as if never moved
    assert [list(a.token_ids) for a in res.alternatives] == samples[0][1:]
    for rid, kw in (
        ("too-many", {"alternatives": 8}),
        ("past", {"alternatives": 1, "alternatives_prompt": 41}),
    ):
        await h.send(turn(rid, **kw))
        res, _ = await h.result(rid)
        assert (res.finish_reason, res.error.code) == ("error", "invalid"), res.error.message
    assert proc.poll() is None


async def test_a_context_delta_is_served_as_its_whole_context_and_an_unknown_one_is_refused(
    engine: Any,
) -> None:
    """The engine keeps each trajectory's context after its turn: the next turn may carry only
    the tokens after it (`context_offset`, with the digest of what it holds), and is generated
    exactly as the whole context would be (greedy, here). A delta over tokens it does not hold
    (another trajectory, another digest, past its end) is refused `context_unknown`, and the
    engine keeps serving."""
    proc, h = engine
    await h.send(turn("first", temperature=0.0))
    first, _ = await h.result("first")
    assert not first.HasField("error")
    held = [*range(100, 140), *first.token_ids]
    new = [150, 151, 152]
    await h.send(
        turn("delta", trajectory_id="traj-first", temperature=0.0, context_token_ids=new,
             context_offset=len(held), context_digest=context_digest(held))
    )  # fmt: skip
    await h.send(turn("whole", trajectory_id="traj-other", temperature=0.0, context_token_ids=held + new))
    delta, _ = await h.result("delta")
    whole, _ = await h.result("whole")
    assert not delta.HasField("error") and not whole.HasField("error"), (delta.error, whole.error)
    assert delta.context_tokens == whole.context_tokens == len(held) + len(new)
    assert list(delta.token_ids) == list(whole.token_ids) and len(delta.token_ids) > 0
    for rid, kw in (
        ("nobody", {"trajectory_id": "traj-nobody", "context_offset": 4, "context_digest": 1}),
        ("digest", {"trajectory_id": "traj-first", "context_offset": len(held), "context_digest": 7}),
        ("past", {"trajectory_id": "traj-first", "context_offset": 10**6, "context_digest": 1}),
    ):
        await h.send(turn(f"unknown-{rid}", context_token_ids=new, **kw))
        res, _ = await h.result(f"unknown-{rid}")
        assert (res.finish_reason, res.error.code) == ("error", "context_unknown"), res.error.message
    await h.send(turn("negative", context_offset=-1))
    res, _ = await h.result("negative")
    assert res.error.code == "invalid"
    await h.send(turn("after-unknown"))
    res, _ = await h.result("after-unknown")
    assert not res.HasField("error") and proc.poll() is None


async def test_an_engine_that_lost_its_lease_refuses_turns_until_leased_again(
    engine: Any, redis_server: Server, run_id: str
) -> None:
    """Another owner took the engine's lease (it was paused, cut off): it must not act any more."""
    proc, h = engine
    store = OwnershipStore.from_url(redis_server.url, run_id)
    resource = lease_resource("rollout", WORKER)
    await store.r.delete(f"libra:{run_id}:lease:{resource}")
    assert await store.acquire(resource, "usurper", 30) is not None
    refused = None
    async with asyncio.timeout(20):  # its next renewal (every quarter of the 10 s TTL) fails
        for i in range(1000):
            await h.send(turn(f"probe-{i}"))
            res, _ = await h.result(f"probe-{i}")
            if res.HasField("error"):
                refused = res
                break
            await asyncio.sleep(0.2)
    assert refused is not None and refused.error.code == "unavailable"
    assert "lease_lost" in refused.error.message and not refused.token_ids

    # the planner leases it again under a new token: it serves again
    await store.r.delete(f"libra:{run_id}:lease:{resource}")
    lease = await store.acquire(resource, WORKER, 10)
    assert lease is not None
    a = ev.Assignment(worker_id=WORKER, role="rollout", bucket="short", fencing_token=lease.token)
    await h.bus.publish_durable(
        subjects.PLAN, ev.Plan(plan_version=2, assignments=[a]), msg_id=f"{run_id}-p2"
    )
    served = None
    async with asyncio.timeout(20):
        for i in range(1000):
            await h.send(turn(f"again-{i}"))
            res, _ = await h.result(f"again-{i}")
            if not res.HasField("error"):
                served = res
                break
            await asyncio.sleep(0.2)
    assert served is not None and len(served.token_ids) > 0
    assert proc.poll() is None
    await store.close()


async def test_shutdown_answers_every_accepted_request(engine: Any) -> None:
    proc, h = engine
    ids = [f"drain-{i}" for i in range(12)]
    for rid in ids:
        await h.send(turn(rid, max_new_tokens=200, stop=[]))
    async with asyncio.timeout(30):
        while not any(load.running or load.waiting for load in h.loads[-3:]):
            await asyncio.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(proc.wait, 30) == 0
    await asyncio.sleep(0.3)
    got = {rid: h.results[rid][0] for rid in ids if rid in h.results}
    assert set(got) == set(ids), f"unanswered: {set(ids) - set(got)}"
    handed_back = [r for r in got.values() if r.finish_reason == "error"]
    assert all(r.error.code == "unavailable" and "shutdown" in r.error.message for r in handed_back)
    assert handed_back, "queued requests are handed back, not run to completion"


async def test_emulated_engine_is_labelled_and_holds_requests_until_weights_arrive(
    nats_server: Server, redis_server: Server, run_id: str
) -> None:
    """In-process, with the emulated backend: no model, so this checks the control plane alone."""
    from services.common.membership import TRAINER_ROLE
    from services.learning.snapshot import snapshot
    from services.trainer.weight_push import encode_dense

    worker = "engine-emu"
    settings = EngineSettings(load_report_interval_s=0.1, max_wait_for_weights_s=30, seed=1)
    run = RunConfig.model_validate({"rollout": {"backend": "emulated", "max_batch": 4}})
    async with in_process_engine(nats_server, redis_server, run_id, worker, settings, run) as (
        _,
        h,
        store,
        hello,
    ):
        await h.send(turn("e1", engine_id=worker, max_new_tokens=5))
        res, _ = await h.result("e1")
        assert res.text.startswith("<emulated") and 1 <= len(res.token_ids) <= 5
        assert len(res.logprobs) == len(res.token_ids) and res.policy_version == 0
        assert any(m.values["emulated"] == 1.0 for m in h.metrics)

        await h.send(turn("e2", engine_id=worker, min_policy_version=1))
        async with asyncio.timeout(10):
            while not h.loads or h.loads[-1].waiting < 1:
                await asyncio.sleep(0.05)
        assert "e2" not in h.results

        import grpc
        import torch

        from services.common.contracts import ws, ws_grpc

        lease = await store.acquire(TRAINER_ROLE, "trainer-x", 30)
        assert lease is not None
        enc = encode_dense(snapshot({"w": torch.ones(4)}, 1), 1 << 20)
        async with grpc.aio.insecure_channel(hello.weight_sync_addr) as ch:
            ack = await ws_grpc.WeightSyncStub(ch).PushWeights(
                iter([ws.WeightChunk(header=enc.header(lease.token, "trainer-x")), *enc.records])
            )
        assert ack.accepted, ack.message
        res, _ = await h.result("e2")
        assert not res.HasField("error") and res.policy_version == 1
        # it checks what it is pushed without torch: a damaged record is refused and changes nothing
        bad = encode_dense(snapshot({"w": torch.full((4,), 2.0)}, 2), 1 << 20)
        records = bad.records
        records[0].data = b"\xff" * 16
        async with grpc.aio.insecure_channel(hello.weight_sync_addr) as ch:
            nack = await ws_grpc.WeightSyncStub(ch).PushWeights(
                iter([ws.WeightChunk(header=bad.header(lease.token, "trainer-x")), *records])
            )
        assert (nack.accepted, nack.code, nack.version) == (False, "checksum_mismatch", 1)


@contextlib.asynccontextmanager
async def in_process_engine(
    nats_server: Server, redis_server: Server, run_id: str, worker: str, settings: Any, run: Any
) -> AsyncIterator[tuple[Any, Harness, OwnershipStore, ev.WorkerHello]]:
    """An engine service in this process, assigned a rollout role by the harness (as the planner
    would): the service, the harness, the store and its hello."""
    from services.common.config import CommonSettings
    from services.rollout_engine.service import RolloutEngineService

    common = CommonSettings(
        nats_url=nats_server.url, redis_url=redis_server.url, run_id=run_id, worker_id=worker
    )
    svc = RolloutEngineService(common, settings, run)
    stop = asyncio.Event()
    bus = await Bus.connect(nats_server.url, run_id, "test", "harness")
    store = OwnershipStore.from_url(redis_server.url, run_id)
    h = Harness(bus, worker)
    await h.start()
    starting = asyncio.create_task(svc.start(stop))
    try:
        hello = await h.assign(store)
        await starting
        yield svc, h, store, hello
    finally:
        stop.set()
        if not starting.done():
            starting.cancel()
        await svc.shutdown()
        await bus.close()
        await store.close()


async def refused_then_served(h: Harness, name: str, back: Callable[[], Awaitable[None]]) -> None:
    """A turn sent now is refused (the engine is out of rollout); after `back`, one is served."""
    await h.send(turn(name))
    res, _ = await h.result(name)
    assert res.error.code == "unavailable" and "draining" in res.error.message
    await back()
    await asyncio.sleep(0.5)
    await h.send(turn(f"{name}-after"))
    res, _ = await h.result(f"{name}-after")
    assert not res.HasField("error") and res.token_ids, res.error


async def test_a_draining_engine_hands_back_every_turn_it_holds_and_takes_no_new_one(
    engine: Any, redis_server: Server, run_id: str
) -> None:
    """The planner moves the engine to `draining`: every turn it holds comes back at once as
    `handed_back` — a running one with the tokens it generated so far (their logprobs and weight
    versions: the scheduler continues the turn from there), a queued one without — a new turn is
    refused, and back in rollout it serves again. An engine on the trainer's GPUs does the same
    when they go back to training (`lent` -> `parked`), and says how many turns it handed back."""
    proc, h = engine
    store = OwnershipStore.from_url(redis_server.url, run_id)
    try:
        held = await store.holder(lease_resource("rollout", WORKER))
        assert held is not None

        async def plan(version: int, role: str) -> None:
            a = ev.Assignment(worker_id=WORKER, role=role, bucket="short", fencing_token=held.token)
            p = ev.Plan(plan_version=version, assignments=[a])
            await h.bus.publish_durable(subjects.PLAN, p, msg_id=f"{run_id}-plan-{version}")

        ids = [f"long-{i}" for i in range(6)]  # max_batch 4: four run, two wait
        for rid in ids:
            await h.send(turn(rid, max_new_tokens=1500, min_new_tokens=1500))
        async with asyncio.timeout(30):
            while not h.loads or h.loads[-1].running < 4:
                await asyncio.sleep(0.05)
        await plan(2, "draining")
        back = [(await h.result(rid, timeout=20))[0] for rid in ids]
        assert all(r.error.code == "handed_back" for r in back), back
        running = [r for r in back if r.token_ids]
        assert len(running) == 4 and all(r.finish_reason == "handed_back" for r in running)
        for r in running:  # what it made so far, as a finished turn would carry it
            assert 0 < len(r.token_ids) < 1500 and len(r.logprobs) == len(r.token_ids) == len(
                r.token_versions
            )
            assert all(lp <= 0.0 for lp in r.logprobs) and set(r.token_versions) == {0}
        assert len(back) - len(running) == 2  # the queued two: nothing generated
        await refused_then_served(h, "during", lambda: plan(3, "rollout"))

        # the same steps when it stands for the trainer's GPUs: parked (they train), lent (serving)
        states: list[ev.HybridState] = []

        async def on_state(m: ev.HybridState, _: Envelope) -> None:
            states.append(m)

        await h.bus.subscribe(subjects.HYBRID_STATE, ev.HybridState, on_state)
        await plan(4, "lent")
        lent = [f"lent-{i}" for i in range(2)]  # with an alternative each (an agent's n = 2)
        await h.send(  # a continued turn: 2 tokens left to it, its alternative starts again (502)
            turn(lent[1], context_token_ids=[*range(100, 140), *range(200, 700)], max_new_tokens=2,
                 min_new_tokens=2, alternatives=1, alternatives_prompt=40)
        )  # fmt: skip
        await asyncio.sleep(1.0)  # its own 2 tokens are out long before (milliseconds each)
        await h.send(turn(lent[0], max_new_tokens=1500, min_new_tokens=1500, alternatives=1))
        async with asyncio.timeout(30):
            while not h.loads or h.loads[-1].running < 3:
                await asyncio.sleep(0.05)
        await plan(5, "parked")  # the trainer takes its GPUs back
        back = [(await h.result(rid, timeout=20))[0] for rid in lent]
        assert all(r.error.code == "handed_back" and not r.alternatives for r in back), back
        assert 0 < len(back[0].token_ids) < 1500  # the turn's own tokens kept, its alternative dropped
        assert not back[1].token_ids  # done, but its alternative was not: all of it goes again
        async with asyncio.timeout(10):
            while not any(m.state == "parked" for m in states):
                await asyncio.sleep(0.05)
        parked = next(m for m in states if m.state == "parked")
        assert (parked.worker_id, parked.fencing_token, parked.turns_handed_back) == (WORKER, held.token, 2)
        await refused_then_served(h, "while-parked", lambda: plan(6, "lent"))
        assert proc.poll() is None
    finally:
        await store.close()


async def test_an_emulated_engine_given_another_tp_restarts_and_a_spare_serves_nothing(
    nats_server: Server, redis_server: Server, run_id: str
) -> None:
    """A re-layout (`planner.relayout`) gives the engine's bucket another TP: an emulated engine
    that has served hands back its running turn with the tokens it generated, pretends to span the
    new TP, and serves again once the weights are loaded at it. Left `spare`, it refuses turns
    (`draining`) and reports `drained`; back in a bucket, it serves."""
    from services.common.membership import SPARE_ROLE

    worker = "engine-relayout"
    settings = EngineSettings(load_report_interval_s=0.1, seed=1)
    run = RunConfig.model_validate(
        {"rollout": {"backend": "emulated", "max_batch": 4, "emulated": {"time_scale": 0.05}}}
    )
    async with in_process_engine(nats_server, redis_server, run_id, worker, settings, run) as (
        svc,
        h,
        store,
        _,
    ):
        states: list[ev.HybridState] = []

        async def on_state(m: ev.HybridState, _: Envelope) -> None:
            states.append(m)

        await h.bus.subscribe(subjects.HYBRID_STATE, ev.HybridState, on_state)
        held = await store.holder(lease_resource("rollout", worker))
        assert held is not None

        async def plan(version: int, role: str, tp: int) -> None:
            a = ev.Assignment(worker_id=worker, role=role, bucket="short", fencing_token=held.token)
            spec = ev.BucketSpec(name="short", tensor_parallel=tp, max_context_tokens=40960)
            p = ev.Plan(plan_version=version, assignments=[a], buckets=[spec])
            await h.bus.publish_durable(subjects.PLAN, p, msg_id=f"{run_id}-relayout-{version}")

        await plan(2, "rollout", 1)
        assert svc.backend.tp == 1
        await h.send(turn("long", engine_id=worker, max_new_tokens=4000, min_new_tokens=4000))
        async with asyncio.timeout(20):
            while not h.loads or h.loads[-1].running < 1:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        await plan(3, "rollout", 4)
        res, _ = await h.result("long", timeout=20)
        assert res.error.code == "handed_back" and 0 < len(res.token_ids) < 4000, res
        assert svc.backend.tp == 4
        await h.send(turn("after-restart", engine_id=worker, max_new_tokens=5))
        res, _ = await h.result("after-restart", timeout=30)
        assert not res.HasField("error") and res.token_ids, res.error

        await plan(4, SPARE_ROLE, 4)
        async with asyncio.timeout(10):
            while not any(m.state == "drained" for m in states):
                await asyncio.sleep(0.05)
        await h.send(turn("while-spare", engine_id=worker))
        res, _ = await h.result("while-spare")
        assert res.error.code == "unavailable" and "draining" in res.error.message
        await plan(5, "rollout", 4)
        await asyncio.sleep(0.3)
        await h.send(turn("back", engine_id=worker, max_new_tokens=5))
        res, _ = await h.result("back", timeout=30)
        assert not res.HasField("error") and res.token_ids, res.error


async def test_a_vllm_engine_serves_hands_back_with_tokens_and_dies_with_its_process(
    tmp_path: Path, nats_server: Server, redis_server: Server, run_id: str, tiny_model: ModelConfig
) -> None:
    """The engine service on real vLLM: turns answered by the contract, bad input refused while it
    serves on, a drain hands back the running turns with their tokens, and `kill -9` of the
    service leaves none of vLLM's processes behind."""
    import psutil

    worker = "engine-v1"
    run = {
        "model": {"source": "tiny-random", "cache_dir": tiny_model.cache_dir},
        # room for turns long enough that none ends before the drain reaches it (600-token turns
        # of the tiny model once finished within the 1.6 s a quiet CI machine took to drain)
        "task": {"max_context_tokens": 2000},
        "rollout": {"backend": "vllm", "max_batch": 2},
    }
    env = pinned_job_env(
        tmp_path, run, nats_server.url, redis_server.url, run_id, worker,
        LIBRA_ROLLOUT_ENGINE_LOAD_REPORT_INTERVAL_S="0.2",
        LIBRA_ROLLOUT_ENGINE_LOAD_HEARTBEAT_S="1", LIBRA_ROLLOUT_ENGINE_STREAM_INTERVAL_S="0.02",
    )  # fmt: skip
    bus = await Bus.connect(nats_server.url, run_id, "test", "harness")
    store = OwnershipStore.from_url(redis_server.url, run_id)
    h = Harness(bus, worker)
    await h.start()
    try:
        with service_process("services.rollout_engine", env, tmp_path / "engine.log") as proc:
            await h.assign(store)
            long_context = list(range(100, 400))  # more than one of vLLM's 128-token CPU blocks
            await h.send(
                turn(
                    "ok",
                    engine_id=worker,
                    context_token_ids=long_context,
                    max_new_tokens=12,
                    min_new_tokens=12,
                )
            )
            res, _ = await h.result("ok", timeout=60)
            assert not res.HasField("error"), res.error
            assert len(res.token_ids) == len(res.logprobs) == len(res.token_versions) == 12
            assert res.finish_reason == "length" and all(lp <= 0 for lp in res.logprobs)
            async with asyncio.timeout(10):  # from vLLM's own scheduler stats, once it has stepped
                while not (h.loads[-1].backend == "vllm" and h.loads[-1].free_kv_tokens > 0):
                    await asyncio.sleep(0.05)
            await h.send(  # with an alternative (an agent's n = 2) sampled beside it
                turn("again", engine_id=worker, context_token_ids=long_context, max_new_tokens=4,
                     min_new_tokens=4, alternatives=1)
            )  # fmt: skip
            again, _ = await h.result("again", timeout=60)
            assert not again.HasField("error") and len(again.alternatives) == 1, again.error
            alt = again.alternatives[0]
            assert len(alt.token_ids) == len(alt.logprobs) == len(alt.token_versions) == 4
            async with asyncio.timeout(10):  # its second turn found the first one's blocks cached
                while not any(m.values.get("prefix_cache_hit_rate", 0) > 0 for m in h.metrics):
                    await asyncio.sleep(0.1)

            await h.send(turn("bad", engine_id=worker, temperature=float("nan")))
            bad, _ = await h.result("bad")
            assert (bad.finish_reason, bad.error.code) == ("error", "invalid")

            held = await store.holder(lease_resource("rollout", worker))
            assert held is not None
            ids = [f"long-{i}" for i in range(3)]  # max_batch 2: two run, one waits
            for rid in ids:
                await h.send(
                    turn(
                        rid, engine_id=worker, max_new_tokens=1900, min_new_tokens=1900, stream=rid == ids[0]
                    )
                )
            async with asyncio.timeout(30):
                while h.loads[-1].running < 2:
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)
            a = ev.Assignment(worker_id=worker, role="draining", bucket="short", fencing_token=held.token)
            plan = ev.Plan(plan_version=2, assignments=[a])
            await bus.publish_durable(subjects.PLAN, plan, msg_id=f"{run_id}-plan-2")
            back = [(await h.result(rid, timeout=20))[0] for rid in ids]
            assert all(r.error.code == "handed_back" for r in back), back
            running = [r for r in back if r.token_ids]
            assert len(running) == 2, "the two running turns come back with what they generated"
            assert all(0 < len(r.token_ids) < 1900 and len(r.logprobs) == len(r.token_ids) for r in running)
            streamed = h.streamed(ids[0])  # vLLM's outputs as they came: what it handed back began so
            assert (
                0 < len(streamed) <= len(back[0].token_ids) and back[0].token_ids[: len(streamed)] == streamed
            )

            vllm_procs = psutil.Process(proc.pid).children(recursive=True)
            assert vllm_procs, "vLLM runs its engine core in processes of its own"
            proc.kill()
            proc.wait()
            _, alive = psutil.wait_procs(vllm_procs, timeout=15)
            assert not alive, f"vLLM processes outlived the engine: {[p.pid for p in alive]}"
    finally:
        await bus.close()
        await store.close()
