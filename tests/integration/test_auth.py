"""Secure defaults on real servers: a stack's NATS only admits its own identities and lets each
publish only what it owns, its Redis wants the password, and WeightSync wants the bearer token."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis

from services.common import subjects
from services.common.bus import Bus, connect_nats
from services.common.config import CommonSettings, load_settings
from services.common.contracts import ev, ws, ws_grpc
from services.common.credentials import IDENTITIES, NatsAuth, StackCredentials, generate
from services.common.errors import CredentialsRefused
from services.common.localstack import Server, start_nats, start_redis
from services.common.ownership import OwnershipStore
from services.common.runconfig import ModelConfig
from services.trainer.weight_push import WeightPusher
from tests.weight_rig import nudged_weights, weight_sync_rig

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> StackCredentials:
    return generate(tmp_path_factory.mktemp("stack") / "secrets")


@pytest.fixture(scope="module")
def secure_nats(creds: StackCredentials, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp_path_factory.mktemp("nats")
    srv = start_nats(d / "data", d / "nats-server.log", config=creds.nats_conf)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def secure_redis(creds: StackCredentials, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_redis(tmp_path_factory.mktemp("redis"), config=creds.redis_conf)
    yield srv
    srv.stop()


def test_secrets_are_private_and_per_identity(creds: StackCredentials) -> None:
    assert stat.S_IMODE(os.stat(creds.root).st_mode) == 0o700
    for identity in IDENTITIES:
        d = creds.identity_dir(identity)
        for f in d.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        has_token = (d / "libra_weight_sync_token").exists()
        assert has_token == (identity in ("rollout-engine", "trainer", "cli")), identity
    passwords = {creds.nats_auth(i).password for i in IDENTITIES}
    assert len(passwords) == len(IDENTITIES)
    # a restarted stack keeps its credentials (and so its Redis data and streams)
    assert generate(creds.root).nats_auth("planner") == creds.nats_auth("planner")


def test_settings_read_one_identity_from_the_secrets_dir(
    creds: StackCredentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIBRA_SECRETS_DIR", str(creds.identity_dir("scheduler")))
    common = load_settings(CommonSettings)
    assert common.nats_auth() == creds.nats_auth("scheduler")
    assert common.redis_secret() == creds.redis_password()
    assert common.grpc_token() is None  # the scheduler never pushes weights
    assert creds.nats_auth("scheduler").password not in repr(common)  # secrets never print
    monkeypatch.setenv("LIBRA_SECRETS_DIR", str(creds.root / "nope"))
    with pytest.raises(SystemExit):
        load_settings(CommonSettings)


async def test_nats_refuses_strangers_at_once(secure_nats: Server, creds: StackCredentials) -> None:
    for auth in (None, NatsAuth("planner", "wrong"), NatsAuth("root", "root")):
        with pytest.raises(CredentialsRefused, match="refused"):
            await asyncio.wait_for(connect_nats(secure_nats.url, "stranger", auth), 10)


async def test_each_identity_publishes_only_what_it_owns(
    secure_nats: Server, creds: StackCredentials, run_id: str
) -> None:
    buses = {i: await Bus.connect(secure_nats.url, run_id, i, i, creds.nats_auth(i)) for i in IDENTITIES}
    seen: list[tuple[str, bytes]] = []

    async def record(msg: Any) -> None:
        seen.append((msg.subject, msg.data))

    watcher = buses["cli"]
    await watcher.nc.subscribe(watcher.subject(">"), cb=record)
    await watcher.nc.flush()
    errors: dict[str, list[str]] = {}
    for identity, bus in buses.items():
        bus.nc._error_cb = _collect(errors.setdefault(identity, []))  # what the forger is told

    forged_plan = ev.Plan(plan_version=10**9, reason="forged")
    forged_traj = ev.CompletedTrajectory(trajectory_id="forged", group_id="g", reward=1.0)
    forgeries = [
        ("scheduler", subjects.PLAN, forged_plan),
        ("rollout-engine", subjects.PLAN, forged_plan),
        ("rollout-engine", subjects.TRAJ_COMPLETED, forged_traj),
        ("tool-sandbox", subjects.TRAJ_COMPLETED, forged_traj),
        ("rollout-engine", subjects.WEIGHTS_UPDATED, ev.WeightsUpdated(version=10**9)),
        ("cli", subjects.TRAIN_METRICS, ev.TrainMetrics(step=9, done=True)),
        # the facts a job's report reads: only their owner may publish them
        ("tool-sandbox", subjects.FACTS_TRAINER, ev.TrainerFacts(step=1000)),
        ("scheduler", subjects.FACTS_TRAINER, ev.TrainerFacts(step=1000)),
        ("rollout-engine", subjects.FACTS_SCHEDULER, ev.SchedulerFacts(published=424242)),
        ("cli", subjects.FACTS_PLANNER, ev.PlannerFacts(plans_total=7)),
    ]
    for identity, suffix, msg in forgeries:
        await buses[identity].publish(suffix, msg)
    owned = [
        ("planner", subjects.PLAN, ev.Plan(plan_version=1, reason="real")),
        ("scheduler", subjects.TRAJ_COMPLETED, ev.CompletedTrajectory(trajectory_id="real")),
        ("trainer", subjects.WEIGHTS_UPDATED, ev.WeightsUpdated(version=1)),
        ("rollout-engine", subjects.TURN_RESULT, ev.TurnResult(trajectory_id="real")),
        ("trainer", subjects.FACTS_TRAINER, ev.TrainerFacts(step=1)),
        ("scheduler", subjects.FACTS_SCHEDULER, ev.SchedulerFacts(published=1)),
        ("planner", subjects.FACTS_PLANNER, ev.PlannerFacts(plans_total=1)),
    ]
    for identity, suffix, msg in owned:
        await buses[identity].publish(suffix, msg)
    for bus in buses.values():
        await bus.nc.flush()
    await asyncio.sleep(0.5)

    got = {s.rsplit(run_id + ".", 1)[1] for s, _ in seen}
    assert got == {suffix for _, suffix, _ in owned}, seen  # every forgery was dropped by the server
    for identity, suffix, _ in forgeries:
        assert any("permissions violation" in e and suffix in e for e in errors[identity]), errors[identity]
    for bus in buses.values():
        await bus.close()
        await bus.nc.close()


async def test_engines_cannot_erase_history(
    secure_nats: Server, creds: StackCredentials, run_id: str
) -> None:
    planner = await Bus.connect(secure_nats.url, run_id, "planner", "p", creds.nats_auth("planner"))
    engine = await Bus.connect(
        secure_nats.url, run_id, "rollout-engine", "e", creds.nats_auth("rollout-engine")
    )
    stream = await planner.ensure_stream("PLAN", [subjects.PLAN], max_msgs_per_subject=1)
    await planner.publish_durable(subjects.PLAN, ev.Plan(plan_version=3), msg_id="p3")
    assert await engine.ensure_stream("PLAN", [subjects.PLAN], max_msgs_per_subject=1) == stream
    with pytest.raises(Exception):  # noqa: B017 - the server answers a denied request with silence
        await engine.js.purge_stream(stream, timeout=1)
    last = await engine.last_message(subjects.PLAN, stream, ev.Plan)
    assert last is not None and last.plan_version == 3
    for bus in (planner, engine):
        await bus.close()
        await bus.nc.close()


async def test_redis_wants_the_password(secure_redis: Server, creds: StackCredentials, run_id: str) -> None:
    anonymous = aioredis.from_url(secure_redis.url)
    with pytest.raises(Exception, match="(?i)auth"):
        await anonymous.ping()
    await anonymous.aclose()
    store = OwnershipStore.from_url(secure_redis.url, run_id, creds.redis_password())
    assert await store.acquire("probe", "me", 5) is not None
    await store.close()


@pytest.fixture
async def engine_rig(
    tiny_model: ModelConfig, secure_redis: Server, creds: StackCredentials, run_id: str
) -> AsyncIterator[dict[str, Any]]:
    async with weight_sync_rig(
        tiny_model,
        secure_redis.url,
        run_id,
        redis_password=creds.redis_password(),
        token=creds.weight_sync_token(),
    ) as rig:
        yield rig


async def test_weight_push_needs_the_bearer_token(
    engine_rig: dict[str, Any], creds: StackCredentials
) -> None:
    engine, addr, fence = engine_rig["engine"], engine_rig["addr"], engine_rig["token"]
    weights = nudged_weights(engine_rig["backend"], 1)
    # the live fencing token alone is not enough: it travels in every plan
    for token in (None, "wrong"):
        pusher = WeightPusher("intruder", 1 << 20, retries=2, backoff_s=0.01, token=token)
        result = (await pusher.push(weights, fence, [addr]))[addr]
        await pusher.close()
        assert (result.in_sync, result.code, result.attempts) == (False, "unauthenticated", 1), result
        assert engine.version == 0
    async with grpc.aio.insecure_channel(addr) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await ws_grpc.WeightSyncStub(ch).GetVersion(ws.VersionRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED

    pusher = WeightPusher("trainer-1", 1 << 20, token=creds.weight_sync_token())
    result = (await pusher.push(weights, fence, [addr]))[addr]
    await pusher.close()
    assert (result.in_sync, result.code) == (True, "ok"), result
    assert engine.version == 1


async def test_a_push_larger_than_the_bound_is_refused_before_buffering(
    engine_rig: dict[str, Any], creds: StackCredentials
) -> None:
    engine, addr = engine_rig["engine"], engine_rig["addr"]
    header = ws.WeightHeader(
        version=1, total_bytes=2 << 30, num_chunks=1, checksum="0" * 64, fencing_token=engine_rig["token"]
    )
    async with grpc.aio.insecure_channel(addr) as ch:

        async def one() -> AsyncIterator[ws.WeightChunk]:
            yield ws.WeightChunk(header=header, index=0, data=b"\0" * 16)

        ack = await ws_grpc.WeightSyncStub(ch).PushWeights(
            one(), timeout=10, metadata=[("authorization", f"Bearer {creds.weight_sync_token()}")]
        )
    assert (ack.accepted, ack.code) == (False, "too_large")
    assert engine.version == 0


def _collect(into: list[str]) -> Any:
    async def cb(e: Exception) -> None:
        into.append(str(e))

    return cb
