"""A worker speaks only for itself, on real servers: with an identity per worker, a worker's user
may publish hello, heartbeats, acks, load and turn results only under its own id, receive only its
own turn requests and renew only its own lease; with identities shared by kind (Kubernetes), no
kind can speak for another; and a receiver refuses a message whose body names someone else than
the subject it came on (docs/security.md)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from nats.aio.msg import Msg

from services.common import control, subjects
from services.common.bus import Bus, Envelope, connect_nats
from services.common.contracts import ev
from services.common.credentials import StackCredentials, generate
from services.common.localstack import Server
from tests.secured import grant_run, secured_nats, secured_redis

pytestmark = pytest.mark.integration

WORKERS = ["planner", "tool-sandbox", "rollout-engine-0", "rollout-engine-1", "trainer", "scheduler"]


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> StackCredentials:
    return generate(tmp_path_factory.mktemp("stack") / "secrets", workers=WORKERS)


@pytest.fixture(scope="module")
def worker_nats(creds: StackCredentials, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with secured_nats(creds, tmp_path_factory) as srv:
        yield srv


async def _bus(srv: Server, creds: StackCredentials, run_id: str, identity: str, worker_id: str) -> Bus:
    kind = next(i.kind for i in creds.identities() if i.name == identity)
    return await Bus.connect(srv.url, run_id, kind, worker_id, creds.nats_auth(identity))


def test_generate_gives_each_worker_its_own_identity(creds: StackCredentials, tmp_path: Any) -> None:
    names = [i.name for i in creds.identities()]
    assert names == [*WORKERS, "cli"]
    assert all(i.per_worker for i in creds.identities() if i.name != "cli")
    assert creds.read("rollout-engine-1", "libra_identity_worker") == "rollout-engine-1"
    passwords = {creds.nats_auth(n).password for n in names}
    assert len(passwords) == len(names)
    # a stack that grows keeps the secrets it had and adds the new worker's
    grown = generate(tmp_path / "c", workers=WORKERS)
    before = grown.nats_auth("rollout-engine-0")
    generate(grown.root, workers=[*WORKERS, "rollout-engine-2"])
    assert grown.nats_auth("rollout-engine-0") == before
    assert grown.nats_auth("rollout-engine-2").user == "rollout-engine-2"
    generate(grown.root, workers=WORKERS)  # and one that shrinks drops the identity it no longer has
    assert not grown.identity_dir("rollout-engine-2").exists()
    with pytest.raises(ValueError, match="kind"):
        generate(tmp_path / "bad", workers=["rollout-engine-0", "gpu-box-7"])
    with pytest.raises(ValueError, match="letters"):
        generate(tmp_path / "bad2", workers=["rollout-engine.0"])


async def test_a_worker_cannot_speak_for_another(
    worker_nats: Server, creds: StackCredentials, run_id: str
) -> None:
    """Holding rollout-engine-1's (or the sandbox's) credentials: hello, heartbeat, ack, load and
    turn results under another worker's id are refused by the server, and so is reading another
    engine's turn requests; under its own id they go through."""
    cli = await _bus(worker_nats, creds, run_id, "cli", "cli")
    seen: list[str] = []

    async def record(msg: Msg) -> None:
        seen.append(msg.subject)

    await cli.nc.subscribe(cli.subject(">"), cb=record)
    for ctl in (control.HEARTBEAT, control.ACK):
        await cli.nc.subscribe(f"{ctl}.>", cb=record)
    await cli.nc.flush()
    errors: dict[str, list[str]] = {}
    forgers = {}
    for identity, as_worker, kind in (
        ("rollout-engine-1", "rollout-engine-0", "rollout-engine"),
        ("tool-sandbox", "rollout-engine-0", "rollout-engine"),
        ("tool-sandbox", "trainer", "trainer"),
    ):
        nc = await connect_nats(worker_nats.url, f"forger-{identity}", creds.nats_auth(identity))
        errors[identity] = into = errors.get(identity, [])

        async def on_error(e: Exception, into: list[str] = into) -> None:
            into.append(str(e))

        nc._error_cb = on_error
        forgers[(identity, as_worker)] = nc
        hello = ev.WorkerHello(worker_id=as_worker, kind=kind, weight_sync_addr="10.6.6.6:1")
        failed = ev.WorkerStatus(worker_id=as_worker, service=kind, state="failed")
        for subject, data in (
            (cli.subject(subjects.spoken(subjects.WORKER_HELLO, kind, as_worker)), hello),
            (cli.subject(subjects.spoken(subjects.TURN_RESULT, kind, as_worker)), ev.TurnResult()),
            (cli.subject(subjects.spoken(subjects.ENGINE_LOAD, kind, as_worker)), ev.EngineLoad()),
            (f"{control.HEARTBEAT}.{kind}.{as_worker}", failed),
            (f"{control.ACK}.{kind}.{as_worker}", ev.JobAck(worker_id=as_worker, service=kind)),
        ):
            await nc.publish(subject, data.SerializeToString())
        await nc.subscribe(cli.subject(f"{subjects.TURN_REQUEST}.rollout-engine-0"), cb=record)
        await nc.flush()
    own = await _bus(worker_nats, creds, run_id, "rollout-engine-1", "rollout-engine-1")
    await own.publish(
        subjects.WORKER_HELLO, ev.WorkerHello(worker_id="rollout-engine-1", kind="rollout-engine")
    )
    await own.publish(subjects.ENGINE_LOAD, ev.EngineLoad(engine_id="rollout-engine-1"))
    await own.nc.subscribe(own.subject(f"{subjects.TURN_REQUEST}.rollout-engine-1"), cb=record)
    scheduler = await _bus(worker_nats, creds, run_id, "scheduler", "scheduler")
    for engine in ("rollout-engine-0", "rollout-engine-1"):
        await scheduler.publish(f"{subjects.TURN_REQUEST}.{engine}", ev.TurnRequest(trajectory_id=engine))
    for b in (own, scheduler):
        await b.nc.flush()
    await asyncio.sleep(0.5)

    assert sorted(set(seen)) == sorted(
        {
            own.subject(subjects.spoken(subjects.WORKER_HELLO, "rollout-engine", "rollout-engine-1")),
            own.subject(subjects.spoken(subjects.ENGINE_LOAD, "rollout-engine", "rollout-engine-1")),
            own.subject(f"{subjects.TURN_REQUEST}.rollout-engine-0"),  # the operator's own watch
            own.subject(f"{subjects.TURN_REQUEST}.rollout-engine-1"),
        }
    ), seen
    # the forgers' own subscriptions to engine-0's requests got nothing (the operator's did: above)
    assert seen.count(own.subject(f"{subjects.TURN_REQUEST}.rollout-engine-0")) == 1, seen
    for identity, errs in errors.items():
        assert sum("permissions violation" in e for e in errs) >= 6, (identity, errs)
    for nc in forgers.values():
        await nc.close()
    for b in (own, scheduler, cli):
        await b.close()


async def test_a_receiver_refuses_a_body_that_names_another_worker(
    worker_nats: Server, creds: StackCredentials, run_id: str
) -> None:
    """Its own subject, someone else's name: a shared kind identity, or a bug, cannot slip a
    message about another worker past the receiver; the receiver serves on."""
    planner = await _bus(worker_nats, creds, run_id, "planner", "planner")
    heard: list[ev.WorkerHello] = []

    async def on_hello(msg: ev.WorkerHello, env: Envelope) -> None:
        heard.append(msg)

    await planner.subscribe(subjects.WORKER_HELLO, ev.WorkerHello, on_hello)
    engine = await _bus(worker_nats, creds, run_id, "rollout-engine-1", "rollout-engine-1")
    await engine.publish(
        subjects.WORKER_HELLO, ev.WorkerHello(worker_id="rollout-engine-0", kind="rollout-engine")
    )
    await engine.publish(subjects.WORKER_HELLO, ev.WorkerHello(worker_id="rollout-engine-1", kind="trainer"))
    await engine.publish(subjects.WORKER_HELLO, ev.WorkerHello(weight_sync_addr="10.0.0.2:50051"))
    await engine.nc.flush()
    for _ in range(50):
        if planner.rejected >= 2 and heard:
            break
        await asyncio.sleep(0.05)
    assert planner.rejected == 2
    # the one that named nobody is filled in from its subject
    assert [(h.worker_id, h.kind, h.weight_sync_addr) for h in heard] == [
        ("rollout-engine-1", "rollout-engine", "10.0.0.2:50051")
    ]
    for b in (planner, engine):
        await b.close()


async def test_a_worker_renews_only_its_own_lease(
    creds: StackCredentials, tmp_path_factory: pytest.TempPathFactory, run_id: str
) -> None:
    with secured_redis(creds, tmp_path_factory) as srv:
        await grant_run(srv, creds, run_id)
        clients = {
            w: aioredis.from_url(srv.url, decode_responses=True, **creds.redis_auth(w))
            for w in ("planner", "rollout-engine-0", "rollout-engine-1", "tool-sandbox")
        }
        lease = f"libra:{run_id}:lease:worker:" + "{}"
        for w in ("rollout-engine-0", "rollout-engine-1", "trainer"):
            await clients["planner"].set(lease.format(w), f"{w}:1", px=60_000)
        assert await clients["rollout-engine-1"].pexpire(lease.format("rollout-engine-1"), 60_000)
        for who, whose in (
            ("rollout-engine-1", "rollout-engine-0"),
            ("tool-sandbox", "rollout-engine-0"),
            ("tool-sandbox", "trainer"),
        ):
            for attempt in (
                clients[who].delete(lease.format(whose)),
                clients[who].pexpire(lease.format(whose), 1),
                clients[who].set(lease.format(whose), f"{who}:9"),
            ):
                with pytest.raises(Exception, match="(?i)permission"):
                    await attempt
            assert await clients["planner"].get(lease.format(whose)) == f"{whose}:1"
            assert await clients[who].get(lease.format(whose)) == f"{whose}:1"  # reading is fine
        for c in clients.values():
            await c.aclose()


async def test_a_worker_writes_only_the_keys_it_owns_in_the_running_job(
    creds: StackCredentials, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Before a job a service may write no key at all; once `libra run` grants run A, each worker
    writes exactly its own keys of A and nothing under another run's name or a longer key name
    (so it cannot make unbounded keys: what it may write is a fixed set, each value at most 1 MB);
    granting run B takes A's keys away. Every refusal is in Redis's ACL log, as the job's report
    counts them."""
    mine = "libra:{run}:lease:worker:rollout-engine-0"
    with secured_redis(creds, tmp_path_factory) as srv:
        engine = aioredis.from_url(srv.url, decode_responses=True, **creds.redis_auth("rollout-engine-0"))
        sched = aioredis.from_url(srv.url, decode_responses=True, **creds.redis_auth("scheduler"))
        with pytest.raises(Exception, match="(?i)permission"):
            await engine.set(mine.format(run="a"), "1")
        await grant_run(srv, creds, "a")
        assert await engine.set(mine.format(run="a"), "1")
        assert await sched.hset("libra:a:scheduler:feed", "k", "v") == 1
        for key in (
            mine.format(run="b"),
            mine.format(run="a") + ":x",
            mine.format(run="a:x"),
            "libra:a:lease:worker:rollout-engine-1",
            "libra:a:scheduler:feed",
            "libra:a:anything",
        ):
            with pytest.raises(Exception, match="(?i)permission"):
                await engine.set(key, "2")
        for key in ("libra:a:scheduler:feed:x", "libra:a:scheduler:other", "libra:b:scheduler:feed"):
            with pytest.raises(Exception, match="(?i)permission"):
                await sched.hset(key, "k", "v")
        keys = await grant_run(srv, creds, "b")
        assert {u.name for u in keys.users} == set(WORKERS)
        with pytest.raises(Exception, match="(?i)permission"):
            await engine.set(mine.format(run="a"), "3")
        assert await engine.set(mine.format(run="b"), "1")
        admin = aioredis.from_url(srv.url, **creds.redis_admin_auth())  # type: ignore[arg-type]
        keys.r = admin
        assert await keys.granted()
        assert (await keys.refused()) == {"rollout-engine-0": {"key": 1}}  # since the grant of b
        with pytest.raises(Exception, match="(?i)permission"):
            await admin.set("libra:b:plans", "x")  # the operator's ACL user touches no key
        for c in (engine, sched, admin):
            await c.aclose()


async def test_shared_kind_identities_cannot_speak_for_another_kind(
    tmp_path_factory: pytest.TempPathFactory, run_id: str
) -> None:
    """Kubernetes' layout (an identity per kind, its pods sharing it): the sandbox still cannot say
    hello as an engine or beat the trainer's heartbeat; an engine speaks for any engine."""
    creds = generate(tmp_path_factory.mktemp("kinds") / "secrets")
    with secured_nats(creds, tmp_path_factory) as srv:
        cli = await _bus(srv, creds, run_id, "cli", "cli")
        seen: list[str] = []

        async def record(msg: Msg) -> None:
            seen.append(msg.subject)

        await cli.nc.subscribe(cli.subject(">"), cb=record)
        await cli.nc.subscribe(f"{control.HEARTBEAT}.>", cb=record)
        await cli.nc.flush()
        sandbox = await connect_nats(srv.url, "sandbox", creds.nats_auth("tool-sandbox"))
        await sandbox.publish(
            cli.subject(subjects.spoken(subjects.WORKER_HELLO, "rollout-engine", "rollout-engine-0")), b""
        )
        await sandbox.publish(f"{control.HEARTBEAT}.trainer.trainer", b"")
        await sandbox.publish(
            cli.subject(subjects.spoken(subjects.WORKER_HELLO, "tool-sandbox", "tool-sandbox-7f")), b""
        )
        engine = await connect_nats(srv.url, "engine", creds.nats_auth("rollout-engine"))
        await engine.publish(
            cli.subject(subjects.spoken(subjects.WORKER_HELLO, "rollout-engine", "rollout-engine-3")), b""
        )
        for nc in (sandbox, engine):
            await nc.flush()
        await asyncio.sleep(0.5)
        assert sorted(seen) == sorted(
            [
                cli.subject(subjects.spoken(subjects.WORKER_HELLO, "tool-sandbox", "tool-sandbox-7f")),
                cli.subject(subjects.spoken(subjects.WORKER_HELLO, "rollout-engine", "rollout-engine-3")),
            ]
        ), seen
        for nc in (sandbox, engine):
            await nc.close()
        await cli.close()
