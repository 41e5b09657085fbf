"""The trainer against real nats-server, Redis and a gRPC WeightSync server, with the tiny model.

One test walks a run: a plan assigns the trainer role; two complete groups, a duplicate, a malformed
and an invalid message arrive; one step trains, version 1 reaches the engine intact, everything is
acked. Then the trainer restarts: it resumes from the checkpoint, skips re-sent trained ids, and the
next two groups give the final step, after which `done` is published.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import yaml
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import subjects
from services.common.bus import Bus
from services.common.config import CommonSettings
from services.common.contracts import ev, ws, ws_grpc
from services.common.errors import DurableStateLost
from services.common.facts import read_facts
from services.common.membership import TRAINER_ROLE
from services.common.models import load_model
from services.common.ownership import OwnershipStore, trained_key
from services.common.runconfig import ModelConfig, load_run_config
from services.common.tracing import tracer
from services.common.weights import check_record
from services.learning.checkpoint import latest
from services.learning.grpo import token_logprobs
from services.rollout_engine.weight_sync import InPlaceWriter
from services.trainer.service import serve

pytestmark = pytest.mark.integration

TRAINER_ID = "trainer-it"


@dataclass
class Push:
    header: ws.WeightHeader
    weights: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    accepted: bool


class RecordingEngine(ws_grpc.WeightSyncServicer):
    """Stands in for a rollout engine: applies each push with the engines' own writer into tensors
    of the header's shapes, checks the state checksum, and records it."""

    def __init__(self) -> None:
        self.version = 0
        self.pushes: list[Push] = []

    async def PushWeights(self, request_iterator: Any, context: Any) -> ws.PushAck:
        header: ws.WeightHeader | None = None
        writer: InPlaceWriter | None = None
        slots: dict[str, torch.Tensor] = {}
        async for chunk in request_iterator:
            if chunk.HasField("header"):
                header = chunk.header
                slots = {s.name: torch.zeros(tuple(s.shape)) for s in header.tensors}
                writer = InPlaceWriter(header.tensors, False, slots)
                continue
            assert header is not None and writer is not None
            await writer.write(chunk, check_record(chunk, header.tensors))
        assert header is not None and writer is not None
        ok = header.version > self.version and await writer.checksum() == header.checksum
        self.pushes.append(Push(header, slots, dict(context.invocation_metadata()), ok))
        if header.version <= self.version:
            return ws.PushAck(accepted=False, version=self.version, code="stale_version")
        if not ok:
            return ws.PushAck(accepted=False, version=self.version, code="checksum_mismatch")
        self.version = header.version
        return ws.PushAck(accepted=True, version=header.version, code="ok")

    async def GetVersion(self, request: Any, context: Any) -> ws.VersionInfo:
        return ws.VersionInfo(engine_id="engine-it", version=self.version)


def span_exporter() -> InMemorySpanExporter:
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def make_group(model: Any, group: str, size: int, seed: int) -> list[ev.CompletedTrajectory]:
    """Well-formed trajectories whose logprobs come from the model itself (temperature 1)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(size):
        prompt = torch.randint(100, 40_000, (6,), generator=gen).tolist()
        turn = torch.randint(100, 40_000, (5,), generator=gen).tolist()
        tool = torch.randint(100, 40_000, (3,), generator=gen).tolist()
        answer = torch.randint(100, 40_000, (4,), generator=gen).tolist()
        ids = torch.tensor([prompt + turn + tool + answer])
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=ids).logits, ids, 1.0)[0].tolist()
        a, b = len(prompt) - 1, len(prompt) + len(turn) + len(tool) - 1
        out.append(
            ev.CompletedTrajectory(
                trajectory_id=f"{group}-{i}",
                group_id=group,
                sample_index=i,
                group_size=size,
                prompt_id=group,
                reward=float(i % 2),
                num_turns=2,
                segments=[
                    ev.Segment(token_ids=prompt),
                    ev.Segment(
                        token_ids=turn, logprobs=lp[a : a + len(turn)], generated=True, temperature=1.0
                    ),
                    ev.Segment(token_ids=tool),
                    ev.Segment(
                        token_ids=answer, logprobs=lp[b : b + len(answer)], generated=True, temperature=1.0
                    ),
                ],
            )
        )
    return out


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 60.0, what: str = "") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


async def test_trainer_trains_once_pushes_and_resumes(
    nats_server, redis_server, run_id: str, tiny_model: ModelConfig, tmp_path: Path, monkeypatch
) -> None:
    spans = span_exporter()
    monkeypatch.setenv("LIBRA_TRAINER_IDLE_POLL_S", "0.2")
    monkeypatch.setenv("LIBRA_TRAINER_RESYNC_INTERVAL_S", "0.3")
    monkeypatch.setenv("LIBRA_TRAINER_PUSH_BACKOFF_S", "0.05")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "model": tiny_model.model_dump(),
                "task": {"group_size": 2, "temperature": 1.0},
                "rollout": {"engines": 1},
                "training": {
                    "steps": 2,
                    "groups_per_step": 2,
                    "micro_batch": 2,
                    "lr": 1e-3,
                    "torch_threads": 1,
                    "checkpoint_dir": str(tmp_path / "ckpt" / "{run_id}"),
                    "push_chunk_bytes": 1 << 20,
                },
            }
        )
    )
    common = CommonSettings(
        run_id=run_id,
        nats_url=nats_server.url,
        redis_url=redis_server.url,
        config=str(cfg),
        worker_id=TRAINER_ID,
    )

    engine = RecordingEngine()
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
    ws_grpc.add_WeightSyncServicer_to_server(engine, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    store = OwnershipStore.from_url(redis_server.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "test", "test-0")
    received: dict[str, list[Any]] = {"metrics": [], "weights": [], "errors": [], "outcomes": []}

    async def collect(kind: str, msg_type: type) -> None:
        async def cb(raw: Any) -> None:
            m = msg_type()
            m.ParseFromString(raw.data)
            received[kind].append(m)

        spoken = subj[kind] in subjects.SPOKEN  # errors: every worker's own subject
        await bus.nc.subscribe(bus.subject(f"{subj[kind]}.>" if spoken else subj[kind]), cb=cb)

    subj = {
        "metrics": subjects.TRAIN_METRICS,
        "weights": subjects.WEIGHTS_UPDATED,
        "errors": subjects.ERRORS,
        "outcomes": subjects.GROUP_OUTCOME,
    }
    await collect("outcomes", ev.GroupOutcome)
    await collect("metrics", ev.TrainMetrics)
    await collect("weights", ev.WeightsUpdated)
    await collect("errors", ev.ErrorEvent)

    traj_stream = subjects.stream_name(run_id, "TRAJ")  # provisioned with the run (conftest.py)

    async def publish(t: ev.CompletedTrajectory) -> None:
        with tracer("test").start_as_current_span("trajectory"):
            await bus.publish_durable(subjects.TRAJ_COMPLETED, t, msg_id=uuid.uuid4().hex)

    model = load_model(tiny_model)
    first = make_group(model, "g0", 2, seed=1) + make_group(model, "g1", 2, seed=2)
    second = make_group(model, "g2", 2, seed=3) + make_group(model, "g3", 2, seed=4)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    model_for_failures = model

    flat = make_group(model, "gz", 2, seed=5)
    for t in flat:  # equal rewards, zero advantage: filtered, and the feed would launch another
        t.reward = 1.0
        await publish(t)
    for t in first:
        await publish(t)
    await publish(first[0])  # a duplicate delivery of a trajectory id
    await bus.js.publish(bus.subject(subjects.TRAJ_COMPLETED), b"\xff\x00 not protobuf")
    # trajectories the trainer cannot take fail their group visibly (the feed replaces it): one
    # logprob short, or tokens at a version the trainer never made (an engine's claim)
    for gid, seed in (("gb", 6), ("gv", 7)):
        bad = make_group(model, gid, 2, seed=seed)[0]
        bad.trajectory_id = f"bad-{gid}"
        if gid == "gb":
            bad.segments[1].logprobs.pop()
        else:
            bad.segments[1].policy_version = 1_000_000
        await publish(bad)
    # a group one of whose trajectories the infrastructure ended: never trained, reported failed
    infra = make_group(model_for_failures, "gf", 2, seed=9)
    infra[1].failure.CopyFrom(ev.ErrorInfo(code="engine_unavailable", message="no engine answered"))
    del infra[1].segments[1:]  # ended before its first turn: the prompt only
    for t in infra:
        await publish(t)

    # the planner's part: lease the trainer role (the trainer renews it) and publish the plan
    lease = await store.acquire(TRAINER_ROLE, TRAINER_ID, 30)
    assert lease is not None
    plan = ev.Plan(
        plan_version=1,
        assignments=[
            ev.Assignment(worker_id=TRAINER_ID, role="train", fencing_token=lease.token),
            ev.Assignment(
                worker_id="engine-it", role="rollout", bucket="short", weight_sync_addr=f"127.0.0.1:{port}"
            ),
        ],
    )
    await bus.publish_durable(subjects.PLAN, plan, msg_id=f"plan-{run_id}")

    async def consumer_settled() -> bool:
        info = await bus.js.consumer_info(traj_stream, "trainer")
        return info.num_ack_pending == 0 and info.num_pending == 0

    async def trained_ids() -> set[str]:
        return set(await store.r.smembers(trained_key(run_id)))

    async def start_trainer() -> tuple[asyncio.Event, asyncio.Task[None], contextlib.AsyncExitStack]:
        stop = asyncio.Event()
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        return stop, asyncio.create_task(serve(common, load_run_config(cfg), stop, stack)), stack

    async def stop_trainer(
        stop: asyncio.Event, task: asyncio.Task[None], stack: contextlib.AsyncExitStack
    ) -> None:
        stop.set()
        await asyncio.wait_for(task, 30)
        await stack.aclose()

    try:
        stop, task, stack = await start_trainer()

        async def step_one() -> bool:
            assert not task.done() or task.exception() is None, task.exception()
            return any(m.step == 1 for m in received["metrics"])

        await eventually(step_one, what="step 1 metrics")
        await eventually(consumer_settled, what="all deliveries settled")
        assert await trained_ids() == {t.trajectory_id for t in first}

        m1 = next(m for m in received["metrics"] if m.step == 1)
        assert m1.weight_version == 1 and m1.trajectories == 4 and not m1.done
        assert m1.tokens == 4 * 9
        assert m1.kl == pytest.approx(0.0, abs=1e-4)  # engine logprobs == trainer's at step start
        assert m1.clip_fraction == 0.0
        # the same tokens under the same weights: the engine-vs-trainer mismatch is numerics only
        assert m1.mismatch_tokens == 4 * 9 and m1.logprob_mismatch < 1e-4
        assert list(m1.policy_versions) == [0] and m1.stale_token_fraction == 0.0
        assert m1.is_weight_mean == pytest.approx(1.0, abs=1e-3) and m1.entropy > 0
        assert m1.lr == pytest.approx(1e-3) and m1.grad_norm > 0
        # the flat group was filtered while the batch filled; its rewards count in what was sampled
        assert m1.groups_filtered == 1 and m1.sampled_trajectories == 6
        assert m1.sampled_reward_mean == pytest.approx((0 + 1 + 0 + 1 + 1 + 1) / 6)

        await eventually(lambda: _true([p for p in engine.pushes if p.accepted]), what="the push")
        accepted = [p for p in engine.pushes if p.accepted]
        assert [p.header.version for p in accepted] == [1]
        push = accepted[0]  # pushed in the background, its state checksum checked by the engine
        assert push.header.fencing_token == lease.token and push.header.sender_id == TRAINER_ID
        assert push.header.num_chunks >= 1 and push.header.format == "tensors-v1"
        weights = push.weights
        assert set(weights) <= set(initial) and "model.embed_tokens.weight" in weights
        assert not torch.equal(weights["model.norm.weight"], initial["model.norm.weight"])
        assert "traceparent" in push.metadata

        await eventually(lambda: _true(received["weights"]), what="WeightsUpdated")
        wu = received["weights"][0]
        assert wu.version == 1 and wu.checksum == push.header.checksum and wu.engines == [f"127.0.0.1:{port}"]

        await eventually(lambda: _true(len(received["outcomes"]) >= 6), what="six group outcomes")
        outcomes = {o.group_id: o for o in received["outcomes"]}
        for gid, why in (("gb", "logprobs"), ("gv", "newer than the trainer's")):
            assert (outcomes[gid].outcome, outcomes[gid].trajectories) == ("invalid", 1), outcomes[gid]
            assert why in outcomes[gid].reason and not outcomes[gid].trained_ids
        assert outcomes["gf"].outcome == "failed" and "no engine answered" in outcomes["gf"].reason
        assert outcomes["gf"].trajectories == 2  # both members acked, neither trained
        assert (outcomes["g0"].outcome, outcomes["g0"].train_step) == ("trained", 1)
        assert outcomes["g1"].outcome == "trained"
        assert sorted(outcomes["g0"].trained_ids) == ["g0-0", "g0-1"]  # the scheduler's ledger hears them
        assert not outcomes["gz"].trained_ids and not outcomes["gf"].trained_ids
        # the commit record, as the trainer publishes it for the job's report
        facts = await read_facts(bus, subjects.FACTS_TRAINER, ev.TrainerFacts)
        record = await store.committed()
        assert facts is not None and (facts.step, facts.version, facts.trained) == (1, 1, 4)
        assert (facts.checkpoint, facts.fencing_token) == (record["checkpoint"], lease.token)
        assert (outcomes["gz"].outcome, outcomes["gz"].trajectories) == ("filtered", 2)
        assert "rewards equal" in outcomes["gz"].reason
        assert not {"gf-0", "gf-1", "gz-0", "gz-1"} & await trained_ids()

        await eventually(lambda: _true(len(received["errors"]) >= 2), what="two error events")
        assert {e.error.code for e in received["errors"]} >= {"malformed", "invalid"}
        assert any("bad-gb" in e.error.message for e in received["errors"])

        step_spans = [s for s in spans.get_finished_spans() if s.name == "train.step" and s.parent is None]
        assert len(step_spans) == 1 and len(step_spans[0].links) == 4
        assert _child(spans.get_finished_spans(), step_spans[0], "weights.push")
        # ...and the step in each trained trajectory's own trace, linked back to the step's span
        in_trajectories = [s for s in spans.get_finished_spans() if s.name == "train.step" and s.parent]
        step_ctx = step_spans[0].context
        assert {s.context.trace_id for s in in_trajectories} == {
            link.context.trace_id for link in step_spans[0].links
        }
        assert all(s.links[0].context.span_id == step_ctx.span_id for s in in_trajectories)
        assert all(s.start_time == step_spans[0].start_time for s in in_trajectories)

        await publish(first[2])  # a duplicate of an id trained in step 1
        await eventually(consumer_settled, what="duplicate acked")

        def reannounced(tid: str) -> list[ev.GroupOutcome]:
            return [o for o in received["outcomes"] if list(o.trained_ids) == [tid]]

        # ...re-announced as trained, alone: a trainer that died between its commit and the
        # outcomes leaves none of its trained trajectories unheard by the scheduler's ledger
        await eventually(lambda: _true(reannounced("g1-0")), what="the duplicate re-announced")
        assert reannounced("g1-0")[0].group_id == "g1" and reannounced("g1-0")[0].outcome == "trained"
        await stop_trainer(stop, task, stack)

        ckpt = latest(tmp_path / "ckpt" / run_id)
        # its epoch; weights only: not a full step (checkpoint_every) nor the last
        assert ckpt is not None and ckpt.name == f"step_00000001-e{lease.token}-weights.pt"

        assert await store.renew(lease, 30)  # the planner keeps the lease while the trainer restarts
        stop, task, stack = await start_trainer()
        for t in first:  # every trained id again, as after a scheduler replay
            await publish(t)
        await eventually(consumer_settled, what="replayed ids acked")
        for t in second:
            await publish(t)

        async def finished() -> bool:
            assert not task.done() or task.exception() is None, task.exception()
            return any(m.done for m in received["metrics"])

        await eventually(finished, what="done metrics")
        await eventually(consumer_settled, what="second step acked")
        steps = sorted(m.step for m in received["metrics"] if not m.done or m.step == 2)
        assert steps.count(1) == 1 and 2 in steps
        final = [m for m in received["metrics"] if m.done]
        assert len(final) == 1 and final[0].weight_version == 2
        assert [p.header.version for p in engine.pushes if p.accepted] == [1, 2]
        assert await trained_ids() == {t.trajectory_id for t in first + second}
        facts = await read_facts(bus, subjects.FACTS_TRAINER, ev.TrainerFacts)
        assert facts is not None and (facts.step, facts.trained, facts.trained_twice) == (2, 8, 0)
        step_spans = [s for s in spans.get_finished_spans() if s.name == "train.step" and s.parent is None]
        assert len(step_spans) == 2
        await stop_trainer(stop, task, stack)
        assert latest(tmp_path / "ckpt" / run_id).name == f"step_00000002-e{lease.token}.pt"  # type: ignore[union-attr]

        # the checkpoint volume is lost: a trainer must not quietly train on from the initial weights
        for path in (tmp_path / "ckpt" / run_id).iterdir():
            path.unlink()
        assert await store.renew(lease, 30)
        stop, task, stack = await start_trainer()
        with pytest.raises(DurableStateLost, match="not there"):
            await asyncio.wait_for(task, 60)
        await stack.aclose()
        assert (await store.committed())["step"] == "2"  # the record is left as it was
    finally:
        await bus.close()
        await store.close()
        await server.stop(None)


async def _true(value: Any) -> bool:
    return bool(value)


def _child(spans: Any, parent: ReadableSpan, name: str) -> bool:
    return any(
        s.name == name and s.parent is not None and s.parent.span_id == parent.context.span_id for s in spans
    )
