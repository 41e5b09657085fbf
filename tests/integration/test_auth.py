"""Secure defaults on real servers: a stack's NATS only admits its own identities and lets each
publish only what it owns, its Redis wants the password, and WeightSync wants the bearer token."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

import grpc
import nats
import pytest
import redis.asyncio as aioredis
import torch
from nats.js.api import ConsumerConfig, RePublish, StreamConfig

from services.common import streams, subjects
from services.common.bus import Bus, connect_nats
from services.common.config import CommonSettings, load_settings
from services.common.contracts import ev, ws, ws_grpc
from services.common.credentials import (
    ALIVE_KINDS,
    IDENTITIES,
    SIGNING_KEY,
    TRAINER_KEYS,
    NatsAuth,
    StackCredentials,
    generate,
    inbox_prefix,
)
from services.common.errors import CredentialsRefused
from services.common.facts import read_facts
from services.common.localstack import Server
from services.common.ownership import OwnershipStore
from services.common.runconfig import ModelConfig
from services.common.streams import SCHEDULER_FEED, TRAINER_FEED
from services.common.weight_signing import HeaderSigner, HeaderVerifier, new_signing_key
from services.learning.snapshot import snapshot
from services.trainer.weight_push import WeightPusher
from tests.secured import grant_run, secured_nats, secured_redis
from tests.weight_rig import nudged_weights, weight_sync_rig
from tools.report import engine_versions

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def creds(tmp_path_factory: pytest.TempPathFactory) -> StackCredentials:
    return generate(tmp_path_factory.mktemp("stack") / "secrets")


@pytest.fixture(scope="module")
def secure_nats(creds: StackCredentials, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with secured_nats(creds, tmp_path_factory) as srv:
        yield srv


@pytest.fixture(scope="module")
def secure_redis(creds: StackCredentials, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with secured_redis(creds, tmp_path_factory) as srv:
        yield srv


def test_redis_is_capped_and_never_evicts(creds: StackCredentials) -> None:
    """A flood of an identity's own keys fills Redis only to its cap, and never evicts a lease or
    a commit record to make room (writes that need memory fail instead)."""
    conf = creds.redis_conf.read_text().splitlines()
    assert "maxmemory 1gb" in conf and "maxmemory-policy noeviction" in conf
    assert "proto-max-bulk-len 1mb" in conf
    assert all(
        "+@scripting" not in line and "-@scripting" in line
        for line in conf
        if line.startswith("user planner")
    )


async def test_no_identity_parks_a_large_value_even_under_its_own_key(
    secure_redis: Server, creds: StackCredentials, run_id: str
) -> None:
    """A value over 1 MB is refused whoever writes it and wherever (the server bounds every bulk
    argument and drops the sender's connection); the key keeps its value, others are served."""
    await grant_run(secure_redis, creds, run_id)
    me = aioredis.from_url(secure_redis.url, **creds.redis_auth("rollout-engine"))
    own = f"libra:{run_id}:lease:worker:rollout-engine-0"
    await me.set(own, b"x" * 1000)  # its own key: allowed
    with pytest.raises(Exception, match="(?i)bulk|protocol|connection"):
        await me.set(own, b"x" * (2 << 20))
    other = aioredis.from_url(secure_redis.url, **creds.redis_auth("planner"))
    assert await other.get(own) == b"x" * 1000
    for r in (me, other):
        await r.aclose()


def test_secrets_are_private_and_per_identity(creds: StackCredentials) -> None:
    assert stat.S_IMODE(os.stat(creds.root).st_mode) == 0o700
    for identity in IDENTITIES:
        d = creds.identity_dir(identity)
        for f in d.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        has_token = (d / "libra_weight_sync_token").exists()
        assert has_token == (identity in ("rollout-engine", "trainer", "cli")), identity
        # only a trainer can sign a weight push; engines hold the public half
        assert (d / SIGNING_KEY).exists() == (identity == "trainer"), identity
        assert (d / TRAINER_KEYS).exists() == (identity == "rollout-engine"), identity
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
    mine = creds.redis_auth("scheduler")
    assert (common.redis_user, common.redis_secret()) == (mine["username"], mine["password"])
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
        # only the trainer lends its GPUs (the planner checks its fencing token too)
        ("rollout-engine", subjects.LEND_REQUEST, ev.LendRequest(want="lend")),
        ("scheduler", subjects.LEND_REQUEST, ev.LendRequest(want="reclaim")),
        ("cli", subjects.LEND_REQUEST, ev.LendRequest(want="lend")),
        # rollout text reaches the job's samples file from the scheduler alone
        ("rollout-engine", subjects.TRAJ_SAMPLE, ev.TrajectorySample(trajectory_id="forged")),
        ("tool-sandbox", subjects.TRAJ_SAMPLE, ev.TrajectorySample(trajectory_id="forged")),
        ("trainer", subjects.TRAJ_SAMPLE, ev.TrajectorySample(trajectory_id="forged")),
        # only the planner probes whether a role holder is there (a forged probe could hold an
        # answer back or make one up; services/planner/registration.py)
        ("scheduler", f"{subjects.ALIVE}.trainer.t", ev.StatsRequest()),
        ("trainer", f"{subjects.ALIVE}.scheduler.s", ev.StatsRequest()),
        ("rollout-engine", f"{subjects.ALIVE}.scheduler.s", ev.StatsRequest()),
        ("tool-sandbox", f"{subjects.ALIVE}.trainer.t", ev.StatsRequest()),
        # a streamed turn's tokens come from rollout engines alone (and a trainer's own engine)
        ("scheduler", subjects.TURN_PROGRESS, ev.TurnProgress(request_id="r", token_ids=[1])),
        ("tool-sandbox", subjects.TURN_PROGRESS, ev.TurnProgress(request_id="r", token_ids=[1])),
        ("planner", subjects.TURN_PROGRESS, ev.TurnProgress(request_id="r", token_ids=[1])),
        # only the scheduler asks for sandboxed agent runs, and only a sandbox says how they went
        ("rollout-engine", subjects.AGENT_RUN, ev.AgentRun(trajectory_id="forged")),
        ("trainer", subjects.AGENT_CANCEL, ev.AgentCancel(trajectory_id="forged")),
        ("scheduler", subjects.AGENT_RETURN, ev.AgentReturn(trajectory_id="forged", answer_json='{"ok": 1}')),
        ("rollout-engine", subjects.AGENT_ACCEPTED, ev.AgentRunAccepted(trajectory_id="forged")),
    ]
    for identity, suffix, msg in forgeries:
        await buses[identity].publish(suffix, msg)
    # each forger's flush returns once the server has handled its publishes, so anything it let
    # through is on its way to the watcher before any of the owned messages below
    for bus in buses.values():
        await bus.nc.flush()
    owned = [
        ("planner", subjects.PLAN, ev.Plan(plan_version=1, reason="real")),
        ("scheduler", subjects.TRAJ_COMPLETED, ev.CompletedTrajectory(trajectory_id="real")),
        ("trainer", subjects.WEIGHTS_UPDATED, ev.WeightsUpdated(version=1)),
        ("rollout-engine", subjects.TURN_RESULT, ev.TurnResult(trajectory_id="real")),
        ("rollout-engine", subjects.TURN_PROGRESS, ev.TurnProgress(engine_id="rollout-engine")),
        ("trainer", subjects.FACTS_TRAINER, ev.TrainerFacts(step=1)),
        ("scheduler", subjects.FACTS_SCHEDULER, ev.SchedulerFacts(published=1)),
        ("planner", subjects.FACTS_PLANNER, ev.PlannerFacts(plans_total=1)),
        ("trainer", subjects.LEND_REQUEST, ev.LendRequest(want="lend")),
        ("scheduler", subjects.TRAJ_SAMPLE, ev.TrajectorySample(trajectory_id="real")),
        ("planner", f"{subjects.ALIVE}.scheduler.s", ev.StatsRequest()),
        ("scheduler", subjects.AGENT_RUN, ev.AgentRun(trajectory_id="real")),
        ("tool-sandbox", subjects.AGENT_RETURN, ev.AgentReturn(trajectory_id="real")),
    ]
    for identity, suffix, msg in owned:
        await buses[identity].publish(suffix, msg)
    for bus in buses.values():
        await bus.nc.flush()
    expected = {buses[identity].outgoing(suffix) for identity, suffix, _ in owned}
    # waits for the owned messages rather than a fixed time: once one CI run saw none of them
    # after 0.5 s; the connections' stats say whether any reached the watcher's socket
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(20):
            while not expected <= {s for s, _ in seen}:
                await asyncio.sleep(0.05)
    got = {s for s, _ in seen}
    stats = {i: (b.nc.is_connected, b.nc.stats) for i, b in buses.items()}
    assert got == expected, (seen, stats)  # every forgery was dropped by the server
    for identity, suffix, _ in forgeries:
        assert any("permissions violation" in e and suffix in e for e in errors[identity]), errors[identity]
    for bus in buses.values():
        await bus.close()
        await bus.nc.close()


SERVICE_IDS = [i for i in IDENTITIES if i != "cli"]


async def _refused(aw: Awaitable[Any]) -> bool:
    """True when the server did not carry the request out (it answers a denied one with silence)."""
    try:
        await aw
    except Exception:
        return True
    return False


@pytest.fixture
async def provisioned(secure_nats: Server, creds: StackCredentials, run_id: str) -> AsyncIterator[Bus]:
    """The run's streams and consumers made by the control identity, one trajectory waiting in the
    trainer's feed and the trainer's facts published, as in a running job."""
    cli = await Bus.connect(secure_nats.url, run_id, "cli", "cli", creds.nats_auth("cli"))
    await streams.provision(cli.js, run_id, ack_wait_s=20.0)  # job.feed_ack_wait_s
    scheduler = await Bus.connect(secure_nats.url, run_id, "scheduler", "s", creds.nats_auth("scheduler"))
    trainer = await Bus.connect(secure_nats.url, run_id, "trainer", "t", creds.nats_auth("trainer"))
    await scheduler.publish_durable(
        subjects.TRAJ_COMPLETED, ev.CompletedTrajectory(trajectory_id="t0"), msg_id="t0"
    )
    await trainer.js.publish(
        trainer.subject(subjects.FACTS_TRAINER), ev.TrainerFacts(step=3).SerializeToString()
    )
    for b in (scheduler, trainer):
        await b.close()
    yield cli
    await cli.close()


@pytest.mark.parametrize("identity", SERVICE_IDS)
async def test_a_service_cannot_touch_what_it_does_not_own(
    provisioned: Bus, secure_nats: Server, creds: StackCredentials, run_id: str, identity: str
) -> None:
    """Holding one service's credentials: no stream or consumer made, changed or erased, no other
    consumer's deliveries taken, no wildcard or foreign subscription, no reply into another
    identity's inbox, no message read outside its list (docs/security.md)."""
    cli = provisioned
    bus = await Bus.connect(secure_nats.url, run_id, identity, "probe", creds.nats_auth(identity))
    errors: list[str] = []
    bus.nc._error_cb = _collect(errors)
    traj = subjects.stream_name(run_id, "TRAJ")
    before = (await cli.js.stream_info(traj)).config
    js = bus.nc.jetstream(timeout=1.0)
    forged = StreamConfig(
        name=f"EVIL_{identity.replace('-', '_').upper()}",
        subjects=["evil.>"],
        republish=RePublish(src="evil.>", dest=bus.subject(subjects.TRAJ_COMPLETED)),
    )
    attempts = {
        "stream create with republish": js.add_stream(forged),
        "stream update": js.update_stream(
            StreamConfig(name=traj, subjects=before.subjects, max_msgs_per_subject=1)
        ),
        "stream delete": js.delete_stream(traj),
        "stream purge": js.purge_stream(traj),
        "consumer create": js.add_consumer(traj, ConsumerConfig(durable_name="thief")),
        "consumer delete": js.delete_consumer(traj, "trainer"),
        "message get": js.get_msg(traj, seq=1),
        "direct get of trajectories": js.get_last_msg(
            traj, bus.subject(subjects.TRAJ_COMPLETED), direct=True
        ),
    }
    if identity != "trainer":
        attempts["pull from the trainer's feed"] = _pull(bus, TRAINER_FEED)
    if identity != "scheduler":
        attempts["pull from the scheduler's feed"] = _pull(bus, SCHEDULER_FEED)
        facts = subjects.stream_name(run_id, "FACTS")
        attempts["read the trainer's facts"] = js.get_last_msg(
            facts, bus.subject(subjects.FACTS_TRAINER), direct=True
        )
    results = dict(
        zip(attempts, await asyncio.gather(*(_refused(a) for a in attempts.values())), strict=True)
    )
    assert all(results.values()), {k: v for k, v in results.items() if not v}

    got: list[str] = []
    # the planner's probes of a role holder reach that holder's kind alone (each scheduler or
    # trainer hears its own: services/common/membership.py); no one else hears them
    alive = [f"{subjects.ALIVE}.>"] + [f"{subjects.ALIVE}.{k}.probe" for k in ALIVE_KINDS if k != identity]
    for subject in (
        ">", "libra.v1.>", f"{inbox_prefix('cli')}.>", bus.subject(subjects.SCHEDULER_STATS),
        *(bus.subject(a) for a in alive),
    ):  # fmt: skip
        if identity == "scheduler" and subject.endswith(subjects.SCHEDULER_STATS):
            continue  # the scheduler answers these
        await bus.nc.subscribe(subject, cb=_append(got))
    await bus.nc.flush()
    await cli.publish(subjects.SCHEDULER_STATS, ev.StatsRequest())
    planner = await Bus.connect(secure_nats.url, run_id, "planner", "p", creds.nats_auth("planner"))
    for kind in ALIVE_KINDS:
        await planner.publish(f"{subjects.ALIVE}.{kind}.probe", ev.StatsRequest())
    await planner.nc.flush()
    await planner.close()
    await planner.nc.close()
    await cli.nc.publish(f"{inbox_prefix('cli')}.probe", b"x")
    forged_replies: list[str] = []  # a reply raced into the operator's inbox does not arrive
    await cli.nc.subscribe(f"{inbox_prefix('cli')}.forged", cb=_append(forged_replies))
    await cli.nc.flush()
    await bus.nc.publish(f"{inbox_prefix('cli')}.forged", b"424242")
    await asyncio.sleep(0.5)
    assert got == [] and forged_replies == [], (got, forged_replies)
    assert sum("permissions violation" in e for e in errors) >= len(attempts) + 1, errors

    # nothing changed: the stream as provisioned, the forged one absent, the feed's delivery waiting
    assert (await cli.js.stream_info(traj)).config.max_msgs_per_subject == before.max_msgs_per_subject
    assert await _refused(cli.js.stream_info(forged.name or ""))
    info = await cli.js.consumer_info(traj, "trainer")
    assert (info.num_pending, info.num_ack_pending) == (1, 0)
    await bus.close()


@pytest.mark.parametrize("identity", ["rollout-engine", "tool-sandbox", "trainer"])
async def test_a_subscriber_cannot_answer_the_planners_plan_publish(
    provisioned: Bus, secure_nats: Server, creds: StackCredentials, run_id: str, identity: str
) -> None:
    """A plan reaches every subscriber with the planner's JetStream ack inbox as its reply
    subject. A service that answers no requests may not publish there: its forged ack is refused
    (a permissions violation), so the planner hears only the stream's own ack."""
    planner = await Bus.connect(secure_nats.url, run_id, "planner", "planner", creds.nats_auth("planner"))
    bus = await Bus.connect(secure_nats.url, run_id, identity, "probe", creds.nats_auth(identity))
    errors: list[str] = []
    bus.nc._error_cb = _collect(errors)
    replies: list[str] = []

    async def forge(msg: Any) -> None:
        replies.append(msg.reply)
        await bus.nc.publish(msg.reply, b'{"stream":"forged","seq":424242}')

    await bus.nc.subscribe(bus.subject(subjects.PLAN), cb=forge)
    await bus.nc.flush()
    plan = ev.Plan(plan_version=7)
    acks = []
    # a busy machine delivers late (0.5 s was once too short, and once in CI no delivery came in
    # 10 s): the plan is published again every 2 s until the subscriber has seen one
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(20):
            for tick in itertools.count():
                if replies and any("permissions violation" in e for e in errors):
                    break
                if not replies and tick % 40 == 0:
                    acks.append(
                        await planner.js.publish(planner.subject(subjects.PLAN), plan.SerializeToString())
                    )
                await asyncio.sleep(0.05)
    assert replies and replies[0].startswith(inbox_prefix("planner")), (len(acks), replies, errors)
    ack = acks[0]
    assert ack.stream == subjects.stream_name(run_id, "PLAN") and ack.seq != 424242
    assert any("permissions violation" in e for e in errors), errors
    assert await planner.last_message(subjects.PLAN, "PLAN", ev.Plan) == plan
    for b in (planner, bus):
        await b.close()


async def test_each_service_does_what_its_role_needs(
    provisioned: Bus, secure_nats: Server, creds: StackCredentials, run_id: str
) -> None:
    """The other side of the fence: each service binds the run's streams, the trainer pulls and
    acks its feed, the scheduler reads the trainer's facts and answers the operator's request."""
    cli = provisioned
    trainer = await Bus.connect(secure_nats.url, run_id, "trainer", "t", creds.nats_auth("trainer"))
    psub, ack_wait = await trainer.bind_consumer(TRAINER_FEED)
    assert ack_wait == 20.0  # as provisioned: the trainer paces its in-progress marks by it
    ((got, raw),) = await trainer.fetch(psub, ev.CompletedTrajectory, 4, 5)
    assert got.trajectory_id == "t0"
    await raw.in_progress()
    await raw.ack()
    scheduler = await Bus.connect(secure_nats.url, run_id, "scheduler", "s", creds.nats_auth("scheduler"))
    facts = await read_facts(scheduler, subjects.FACTS_TRAINER, ev.TrainerFacts)
    assert facts is not None and facts.step == 3

    async def stats(_: ev.StatsRequest, __: Any) -> ev.SchedulerStats:
        return ev.SchedulerStats(trajectories_completed=7)

    await scheduler.subscribe(subjects.SCHEDULER_STATS, ev.StatsRequest, stats)
    for attempt in range(20):  # the subscription is flushed, yet a loaded server once said "no responders"
        try:
            answer = await cli.request(subjects.SCHEDULER_STATS, ev.StatsRequest(), ev.SchedulerStats)
            break
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.1 * (attempt + 1))
    else:
        pytest.fail("the scheduler never answered the operator's request")
    assert answer.trajectories_completed == 7
    for identity in SERVICE_IDS:
        bus = await Bus.connect(secure_nats.url, run_id, identity, "b", creds.nats_auth(identity))
        assert await bus.bind_stream("PLAN") == subjects.stream_name(run_id, "PLAN")
        assert await bus.last_message(subjects.PLAN, "PLAN", ev.Plan) is None
        await bus.close()
    info = await cli.js.consumer_info(subjects.stream_name(run_id, "TRAJ"), "trainer")
    assert (info.num_pending, info.num_ack_pending) == (0, 0)
    for b in (trainer, scheduler):
        await b.close()


def _append(into: list[Any]) -> Any:
    async def cb(msg: Any) -> None:
        into.append(msg.subject)

    return cb


async def _pull(bus: Bus, spec: streams.ConsumerSpec) -> None:
    stream = subjects.stream_name(bus.run_id, spec.stream)
    psub = await bus.nc.jetstream(timeout=1.0).pull_subscribe_bind(durable=spec.durable, stream=stream)
    msgs = await psub.fetch(1, timeout=1)
    for m in msgs:
        await m.ack()


async def test_redis_wants_the_password(secure_redis: Server, creds: StackCredentials, run_id: str) -> None:
    anonymous = aioredis.from_url(secure_redis.url)
    with pytest.raises(Exception, match="(?i)auth"):
        await anonymous.ping()
    await anonymous.aclose()
    planner = creds.redis_auth("planner")
    wrong = aioredis.from_url(
        secure_redis.url, username="planner", password=creds.redis_auth("trainer")["password"]
    )
    with pytest.raises(Exception, match="(?i)auth|invalid"):
        await wrong.ping()
    await wrong.aclose()
    await grant_run(secure_redis, creds, run_id)
    store = OwnershipStore.from_url(
        secure_redis.url, run_id, planner["password"], username=planner["username"]
    )
    assert await store.acquire("worker:rollout-engine-0", "me", 5) is not None
    await store.close()


# Who may write each kind of Redis key (services/common/credentials.py); the first one writes it here.
_WRITERS = {
    "trainer:committed": ("trainer",),
    "trained": ("trainer",),
    "lease:role:trainer": ("planner", "trainer"),  # the planner leases the role, the trainer renews it
    "scheduler:published": ("scheduler",),
    "scheduler:heard_trained": ("scheduler",),
    "plans": ("planner",),
    "role_changes": ("planner",),
    "fence:worker:rollout-engine-0": ("planner",),
    "lease:role:planner": ("planner",),
}


@pytest.mark.parametrize("identity", IDENTITIES)
async def test_each_identity_writes_only_its_own_redis_keys(
    secure_redis: Server, creds: StackCredentials, run_id: str, identity: str
) -> None:
    """Holding one identity's Redis user: every other owner's key is refused for writing (and left
    as it was), and nothing server-wide (FLUSHALL, KEYS, CONFIG, ACL) is allowed; nor is anything
    that could hold the server or list what others keep: scripts (EVAL, SCRIPT, FUNCTION), SCAN,
    RANDOMKEY, DBSIZE, another database, CLIENT TRACKING. Its own keys are."""
    await grant_run(secure_redis, creds, run_id)
    admin: dict[str, aioredis.Redis] = {
        i: aioredis.from_url(secure_redis.url, decode_responses=True, **creds.redis_auth(i))
        for i in IDENTITIES
    }
    for k, writers in _WRITERS.items():
        await admin[writers[0]].hset(f"libra:{run_id}:{k}", "v", writers[0])
    me = admin[identity]
    for k, writers in _WRITERS.items():
        key = f"libra:{run_id}:{k}"
        try:
            await me.hset(key, "v", "forged")
            wrote = True
        except Exception as err:
            assert "permission" in str(err).lower(), err
            wrote = False
        assert wrote == (identity in writers), (identity, key)
        if not wrote:
            assert await admin[writers[0]].hget(key, "v") == writers[0]
    for name, call in (
        ("flushall", me.flushall()),
        ("keys", me.keys("*")),
        ("config", me.config_set("requirepass", "")),
        ("acl", me.acl_setuser("default", enabled=True, nopass=True)),
        ("eval", me.eval("return 1", 0)),
        ("script", me.script_flush()),
        (
            "function_load",
            me.function_load("#!lua name=x\nredis.register_function('f', function() return 1 end)"),
        ),
        ("function_flush", me.function_flush()),
        ("scan", me.scan(0)),
        ("randomkey", me.randomkey()),
        ("dbsize", me.dbsize()),
        ("select", me.execute_command("SELECT", 1)),
        ("tracking", me.execute_command("CLIENT", "TRACKING", "ON", "BCAST")),
        ("client_list", me.client_list()),
    ):
        with pytest.raises(Exception, match="(?i)permission"):
            await call
        assert name
    worker_lease = f"libra:{run_id}:lease:worker:rollout-engine-0"  # a worker renews its own lease
    can_renew = identity in ("planner", "rollout-engine")  # (a kind's shared identity: its kind's)
    try:
        await me.pexpire(worker_lease, 10_000)
        renewed = True
    except Exception:
        renewed = False
    assert renewed == can_renew, identity
    if identity != "planner":  # the planner alone hands out fencing tokens
        with pytest.raises(Exception, match="(?i)permission"):
            await me.incr(f"libra:{run_id}:fence:worker:rollout-engine-0")
    for r in admin.values():
        await r.aclose()


@pytest.fixture
async def engine_rig(
    tiny_model: ModelConfig, secure_redis: Server, creds: StackCredentials, run_id: str
) -> AsyncIterator[dict[str, Any]]:
    await grant_run(secure_redis, creds, run_id)
    async with weight_sync_rig(
        tiny_model,
        secure_redis.url,
        run_id,
        redis_auth=creds.redis_auth("planner"),  # the rig leases the trainer role, as the planner does
        token=creds.weight_sync_token(),
        verifier=HeaderVerifier.from_json(creds.read("rollout-engine", TRAINER_KEYS)),
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

    pusher = WeightPusher("trainer-1", 1 << 20, token=creds.weight_sync_token(), signer=trainer_signer(creds))
    result = (await pusher.push(weights, fence, [addr]))[addr]
    await pusher.close()
    assert (result.in_sync, result.code) == (True, "ok"), result
    assert engine.version == 1


def trainer_signer(creds: StackCredentials) -> HeaderSigner:
    return HeaderSigner(creds.read("trainer", SIGNING_KEY))


async def test_an_engine_cannot_push_weights_into_another_engine(
    engine_rig: dict[str, Any], creds: StackCredentials
) -> None:
    """An engine holds the bearer token (it relays pushes) and can read the live fencing token (it
    travels in every plan): neither makes it the trainer. All-zero weights at a huge version,
    unsigned, signed with a key of its own, or in another sender's name, change nothing; the
    trainer's next push still lands."""
    engine, addr, fence = engine_rig["engine"], engine_rig["addr"], engine_rig["token"]
    before = engine.checksum
    zeros = snapshot(
        {k: torch.zeros_like(v) for k, v in engine_rig["backend"].model.named_parameters()}, 1_000_000
    )
    attacks = [
        ("trainer-1", None),  # unsigned, in the trainer's name
        ("trainer-1", HeaderSigner(new_signing_key())),  # signed, with the engine's own key
        ("rollout-engine", HeaderSigner(new_signing_key())),  # as itself
    ]
    for sender, signer in attacks:
        pusher = WeightPusher(sender, 1 << 20, retries=0, token=creds.weight_sync_token(), signer=signer)
        result = (await pusher.push(zeros, fence, [addr]))[addr]
        await pusher.close()
        assert (result.in_sync, result.code) == (False, "unauthorized"), (sender, result)
        assert (engine.version, engine.checksum, engine.torn) == (0, before, False)
    # a trainer's key, but not the trainer that holds the lease with this fencing token
    pusher = WeightPusher(
        "trainer-2", 1 << 20, retries=0, token=creds.weight_sync_token(), signer=trainer_signer(creds)
    )
    result = (await pusher.push(zeros, fence, [addr]))[addr]
    await pusher.close()
    assert (result.in_sync, result.code) == (False, "unauthorized"), result
    assert engine.version == 0

    weights = nudged_weights(engine_rig["backend"], 1)
    pusher = WeightPusher("trainer-1", 1 << 20, token=creds.weight_sync_token(), signer=trainer_signer(creds))
    result = (await pusher.push(weights, fence, [addr]))[addr]
    await pusher.close()
    assert (result.in_sync, engine.version, engine.checksum) == (True, 1, weights.checksum), result


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


async def test_the_report_asks_engines_only_at_the_planners_address(
    engine_rig: dict[str, Any], creds: StackCredentials
) -> None:
    """A heartbeat naming another address for an engine (any service may send heartbeats) gets
    neither a call nor the bearer token: `libra run` asks the address the planner's plan has."""
    calls: list[int] = []
    trap = await asyncio.start_server(lambda _r, w: (calls.append(1), w.close()), "127.0.0.1", 0)
    forged = f"127.0.0.1:{trap.sockets[0].getsockname()[1]}"
    known, stranger = (
        ev.WorkerStatus(worker_id=w, service="rollout-engine") for w in ("engine-a", "engine-x")
    )
    for st in (known, stranger):
        st.detail["weight_sync_addr"] = forged
    plan = ev.Plan(
        assignments=[
            ev.Assignment(
                worker_id="engine-a", role="rollout", bucket="short", weight_sync_addr=engine_rig["addr"]
            )
        ]
    )
    out = await engine_versions([known, stranger], plan, creds.weight_sync_token())
    trap.close()
    assert (out[0]["weight_sync_addr"], out[0]["weight_version"], out[0]["bucket"]) == (
        engine_rig["addr"],
        0,
        "short",
    )
    assert out[1]["weight_version"] is None and "plan" in out[1]["error"], out[1]
    assert calls == []


def _collect(into: list[str]) -> Any:
    async def cb(e: Exception) -> None:
        into.append(str(e))

    return cb
