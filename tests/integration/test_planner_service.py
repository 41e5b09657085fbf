"""The planner shell on real NATS and Redis: it leases workers, publishes plans with buckets, hands
the trainer's and the scheduler's role to a standby when the lease runs out, and outlives a Redis restart."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.common import lending, subjects
from services.common.bus import Bus, Envelope, Refused
from services.common.contracts import ev
from services.common.facts import read_facts
from services.common.localstack import Server, start_redis
from services.common.membership import SCHEDULER_ROLE, TRAINER_ROLE, Membership, lease_resource
from services.common.ownership import Lease, OwnershipStore, plans_key, role_changes_key
from services.common.runconfig import RunConfig
from services.planner.config import PlannerSettings
from services.planner.service import PlannerService
from tests.speaking import speak
from tools.report import role_changes

pytestmark = pytest.mark.integration


@pytest.fixture
async def rig(
    request: pytest.FixtureRequest, nats_server: Server, run_id: str, tmp_path: Path
) -> AsyncIterator[dict[str, Any]]:
    """A planner on its own Redis; leases of 2 s unless a test asks for other (indirect param)."""
    redis = start_redis(tmp_path / "redis")  # its own: this test restarts it
    store = OwnershipStore.from_url(redis.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "planner", "planner")
    watcher = await Bus.connect(nats_server.url, run_id, "test", "watcher")
    plans = await _watch_plans(watcher)
    cfg = RunConfig.model_validate({"job": {"lease_ttl_s": getattr(request, "param", 2.0)}})
    planner = PlannerService(PlannerSettings(tick_s=0.1), cfg, bus, store)
    await planner.start()
    try:
        yield {"planner": planner, "store": store, "watcher": watcher, "plans": plans, "redis": redis}
    finally:
        for b in (bus, watcher):
            await b.close()
            await b.nc.close()
        await store.close()
        redis.stop()


async def _watch_plans(watcher: Bus) -> list[ev.Plan]:
    """Every plan published from now on, in order."""
    plans: list[ev.Plan] = []

    async def on_plan(p: ev.Plan, _: Envelope) -> None:
        plans.append(p)

    await watcher.subscribe(subjects.PLAN, ev.Plan, on_plan)
    return plans


async def _until(what: str, cond: Any, timeout: float = 15.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.05)


async def _hello_engines(watcher: Bus, ids: list[str]) -> None:
    """Each engine says hello, at an address of its own."""
    for i, wid in enumerate(ids):
        await speak(
            watcher,
            subjects.WORKER_HELLO,
            ev.WorkerHello(worker_id=wid, kind="rollout-engine", weight_sync_addr=f"x:{i}"),
        )


def _roles(plan: ev.Plan) -> dict[str, str]:
    return {a.worker_id: a.role for a in plan.assignments}


async def test_standby_takes_the_trainer_role_and_the_planner_outlives_redis(rig: dict[str, Any]) -> None:
    watcher, plans, store = rig["watcher"], rig["plans"], rig["store"]
    kinds = {"engine": "rollout-engine", "trainer": "trainer", "scheduler": "scheduler"}
    for wid in ("trainer-a", "trainer-b", "engine-0", "scheduler-a", "scheduler-b"):
        kind = kinds[wid.split("-")[0]]
        await speak(
            watcher, subjects.WORKER_HELLO, ev.WorkerHello(worker_id=wid, kind=kind, weight_sync_addr="x:1")
        )
    await _until("plan", lambda: plans and len(plans[-1].assignments) == 5)
    plan = plans[-1]
    assert _roles(plan) == {
        "trainer-a": "train",
        "trainer-b": "standby",
        "engine-0": "rollout",
        "scheduler-a": "schedule",
        "scheduler-b": "standby",
    }
    assert [(b.name, b.tensor_parallel) for b in plan.buckets] == [("short", 1)] and plan.lease_ttl_s == 2.0

    # Redis goes away and comes back (same port and data): the planner's loop lives on
    rig["redis"].proc.kill()
    rig["redis"].proc.wait()
    await asyncio.sleep(0.5)  # a few ticks fail meanwhile
    rig["redis"].restart()

    # the engine and the standbys keep renewing what the latest plan gives them; trainer-a and
    # scheduler-a do not (they died): their leases run out and each standby takes its kind's role
    # under a new token
    async def live_workers() -> None:
        while True:
            for a in plans[-1].assignments:
                if a.worker_id in ("engine-0", "trainer-b", "scheduler-b"):
                    lease = Lease(lease_resource(a.role, a.worker_id), a.worker_id, a.fencing_token)
                    await store.renew(lease, 2.0)
            await asyncio.sleep(0.3)

    keeper = asyncio.create_task(live_workers())
    try:
        await _until(
            "takeover",
            lambda: (
                _roles(plans[-1]) == {"trainer-b": "train", "engine-0": "rollout", "scheduler-b": "schedule"}
            ),
            timeout=20,
        )
    finally:
        keeper.cancel()
    final = plans[-1]
    for role, worker in ((TRAINER_ROLE, "trainer-b"), (SCHEDULER_ROLE, "scheduler-b")):
        held = await store.holder(role)
        token = next(a.fencing_token for a in final.assignments if a.worker_id == worker)
        assert held is not None and held.owner == worker and held.token == token


@pytest.mark.parametrize("rig", [60.0], indirect=True)
async def test_a_role_holder_whose_process_is_gone_is_replaced_by_its_standby_before_its_lease_ends(
    rig: dict[str, Any], nats_server: Server, run_id: str
) -> None:
    """A scheduler killed outright: NATS has nobody on its probe subject any more, and the planner
    gives the warm standby the role within seconds, not when the holder's 60 s lease runs out. While
    the holder answers its probes it keeps the role."""
    plans, store = rig["plans"], rig["store"]
    buses: dict[str, Bus] = {}
    for wid in ("scheduler-a", "scheduler-b"):  # in this order: a takes the role, b stands by
        bus = buses[wid] = await Bus.connect(nats_server.url, run_id, "scheduler", wid)
        await Membership(bus, store, ev.WorkerHello(worker_id=wid, kind="scheduler")).start()
        await _until(wid, lambda wid=wid: plans and wid in _roles(plans[-1]))  # type: ignore[misc]
    assert _roles(plans[-1]) == {"scheduler-a": "schedule", "scheduler-b": "standby"}
    try:
        await asyncio.sleep(PlannerSettings().gone_s + 1.0)  # answering: nothing moves
        assert _roles(plans[-1]) == {"scheduler-a": "schedule", "scheduler-b": "standby"}
        held = await store.holder(SCHEDULER_ROLE)
        assert held is not None and held.owner == "scheduler-a"

        gone = time.monotonic()
        await buses.pop("scheduler-a").close()  # its process dies: its connection goes with it
        await _until("takeover", lambda: _roles(plans[-1]) == {"scheduler-b": "schedule"}, timeout=20)
        assert time.monotonic() - gone < 20  # the lease had 55 s or more to run
        held = await store.holder(SCHEDULER_ROLE)
        token = next(a.fencing_token for a in plans[-1].assignments if a.worker_id == "scheduler-b")
        assert held is not None and held.owner == "scheduler-b" and held.token == token
    finally:
        for bus in buses.values():
            await bus.close()


async def test_the_planner_refits_buckets_live_under_its_own_epoch_and_a_replaced_planner_goes_quiet(
    nats_server: Server, run_id: str, redis_server: Server
) -> None:
    """Workload stats whose lengths do not fit the configured threshold (40,000 tokens: every
    trajectory in the short bucket) make the planner simulate its candidates and publish the
    fastest as a re-fitted plan (reason, predicted gain, its lease's epoch, what it simulated) and
    record it in the run's plan history. When another planner takes the lease, the first one publishes nothing
    more, and a worker that follows the new epoch refuses the old one's plan."""
    from services.common.membership import Membership
    from services.planner.history import PLANNER_ROLE

    cfg = RunConfig.model_validate(
        {
            "rollout": {
                "engines": 4,
                "backend": "emulated",
                "max_batch": 16,
                "buckets": [
                    {"name": "short", "max_output_tokens": 40000},
                    {"name": "long", "tensor_parallel": 2},
                ],
            },
            "training": {"groups_per_step": 16},  # 64 trajectories a step: throughput, not one tail
            "task": {"max_context_tokens": 40960},  # the window the stats' lengths need
            "job": {"lease_ttl_s": 60.0},  # nobody renews the engines' leases here
            "planner": {
                "interval_s": 0.3,
                "cooldown_s": 0.0,
                "min_samples": 32,
                # simulating the candidates took over the default 2 s on a loaded CI runner, and
                # the analytical model chose: this test is about the simulation choosing
                "what_if": {"budget_s": 30.0},
            },
        }
    )
    store = OwnershipStore.from_url(redis_server.url, run_id)
    bus_a = await Bus.connect(nats_server.url, run_id, "planner", "planner-a")
    bus_b = await Bus.connect(nats_server.url, run_id, "planner", "planner-b")
    watcher = await Bus.connect(nats_server.url, run_id, "test", "watcher")
    plans = await _watch_plans(watcher)
    first = PlannerService(PlannerSettings(tick_s=0.1), cfg, bus_a, store, "planner-a")
    await first.start()
    try:
        await _hello_engines(watcher, [f"engine-{i}" for i in range(4)])
        await _until("plan", lambda: plans and len(plans[-1].assignments) == 4)
        epoch = plans[-1].planner_epoch
        assert epoch > 0 and plans[-1].reason in ("static", "membership")
        assert [(b.name, b.max_output_tokens) for b in plans[-1].buckets] == [("short", 40000), ("long", 0)]

        rng = random.Random(0)
        lengths = [int(rng.gauss(2000, 300)) for _ in range(180)] + [
            int(rng.gauss(30000, 3000)) for _ in range(20)
        ]
        stats = ev.WorkloadStats(
            trajectory_output_tokens=lengths,
            tool_s_per_turn=5.0,
            prompt_tokens=2000,
            turns_per_trajectory_mean=6,
        )
        await watcher.publish(subjects.WORKLOAD_STATS, stats)
        await _until("refit", lambda: plans[-1].reason.startswith("replan:"))
        refit = plans[-1]
        assert refit.planner_epoch == epoch and refit.predicted_gain > 0.03
        short = refit.buckets[0].max_output_tokens
        assert 1500 <= short < 30000 and refit.buckets[1].max_output_tokens == 0
        assert len(refit.assignments) == 4, "the workers stay where they are"
        history = [json.loads(x) for x in await store.r.lrange(plans_key(run_id), 0, -1)]
        assert history[-1]["reason"] == refit.reason and history[-1]["buckets"]["short"] == short
        decision = history[-1]["decision"]  # chosen by simulating the candidates, within budget
        assert decision["scored_by"] == "simulation" and decision["candidates"][0]["label"] == "current"
        assert decision["decision_s"] > 0 and decision["budget_s"] == 30.0
        assert all(h["epoch"] == epoch for h in history)

        # a worker following this planner
        follower = Membership(watcher, store, ev.WorkerHello(worker_id="engine-0", kind="rollout-engine"))
        await follower._apply(refit)

        # the lease passes to another planner (the first one was paused past its TTL, say): one
        # atomic write, so the first planner cannot take it back in between
        await store.r.hset(f"libra:{run_id}:lease:{PLANNER_ROLE}", "owner", "planner-b")
        second = PlannerService(PlannerSettings(tick_s=0.1), cfg, bus_b, store, "planner-b")
        await second.start()
        await _until("takeover", lambda: plans[-1].planner_epoch > epoch)
        new_epoch, takeover = plans[-1].planner_epoch, len(plans) - 1
        assert [b.max_output_tokens for b in plans[-1].buckets] == [short, 0], "it continues the plan"
        await follower._apply(plans[-1])
        await asyncio.sleep(1.0)  # the first planner's ticks: its renewal fails, it stays quiet
        assert first.lease is None and all(p.planner_epoch == new_epoch for p in plans[takeover:])
        seen = len(plans)
        first.dirty = True  # even with something to say
        await asyncio.sleep(0.5)
        assert len(plans) == seen
        # a plan from the old epoch, however new its version, is refused by the follower
        forged = ev.Plan(plan_version=999, planner_epoch=epoch, reason="forged", assignments=[])
        await follower._apply(forged)
        assert follower.plan is not None and follower.plan.planner_epoch == new_epoch
        assert follower.assignment is not None and follower.assignment.worker_id == "engine-0"
        # the history as the new planner publishes it for the job's report: the first planner's
        # plans (read back from Redis) and its own, all that Redis holds
        history = [json.loads(x) for x in await store.r.lrange(plans_key(run_id), 0, -1)]
        facts = await read_facts(watcher, subjects.FACTS_PLANNER, ev.PlannerFacts)
        assert facts is not None and facts.plans_total == len(history) > 2
        assert [json.loads(x) for x in facts.plans] == history
        assert {h["epoch"] for h in history} == {epoch, new_epoch}
    finally:
        for b in (bus_a, bus_b, watcher):
            await b.close()
            await b.nc.close()
        await store.close()


async def test_an_operator_drains_an_engine_and_brings_it_back_through_the_planner(
    rig: dict[str, Any],
) -> None:
    """A role request moves an engine out of rollout (`draining`) and back, under its fencing
    token: the plan goes out at once and the change on plan.role_change; nonsense is refused with a
    typed error and changes nothing."""
    watcher, plans = rig["watcher"], rig["plans"]
    changes: list[ev.RoleChange] = []

    async def on_change(m: ev.RoleChange, _: Envelope) -> None:
        changes.append(m)

    await watcher.subscribe(subjects.ROLE_CHANGE, ev.RoleChange, on_change)
    for wid in ("engine-0", "engine-1", "trainer-a"):
        kind = "rollout-engine" if wid.startswith("engine") else "trainer"
        await speak(
            watcher, subjects.WORKER_HELLO, ev.WorkerHello(worker_id=wid, kind=kind, weight_sync_addr="x:1")
        )
    await _until("plan", lambda: plans and len(plans[-1].assignments) == 3)
    token = next(a.fencing_token for a in plans[-1].assignments if a.worker_id == "engine-0")

    ack = await watcher.request(
        subjects.ROLE_REQUEST, ev.RoleChange(worker_id="engine-0", to_role="draining"), ev.RoleChange
    )
    assert (ack.from_role, ack.to_role, ack.fencing_token) == ("rollout", "draining", token)
    await _until("drained", lambda: _roles(plans[-1]).get("engine-0") == "draining")
    assert plans[-1].reason == "role_change:engine-0:rollout->draining"
    await _until("event", lambda: changes and changes[-1].to_role == "draining")

    for bad in (
        ev.RoleChange(worker_id="ghost", to_role="draining"),
        ev.RoleChange(worker_id="trainer-a", to_role="draining"),
        ev.RoleChange(worker_id="engine-1", to_role="rollout", bucket="nowhere"),
    ):
        seen = len(plans)
        err = await watcher.request(subjects.ROLE_REQUEST, bad, ev.ErrorEvent)
        assert err.error.code == "invalid", err
        await asyncio.sleep(0.3)
        assert len(plans) == seen and _roles(plans[-1])["trainer-a"] == "train"

    back = await watcher.request(
        subjects.ROLE_REQUEST, ev.RoleChange(worker_id="engine-0", to_role="rollout"), ev.RoleChange
    )
    assert (back.from_role, back.to_role, back.bucket) == ("draining", "rollout", "short")
    await _until("back", lambda: _roles(plans[-1]).get("engine-0") == "rollout")

    # into the hybrid pool and back; the workers' steps are kept with the changes, under their token
    hybrid = await watcher.request(
        subjects.ROLE_REQUEST, ev.RoleChange(worker_id="engine-1", to_role="hybrid"), ev.RoleChange
    )
    assert (hybrid.from_role, hybrid.to_role) == ("rollout", "hybrid")
    await _until("hybrid", lambda: _roles(plans[-1]).get("engine-1") == "hybrid")
    token_1 = hybrid.fencing_token
    for state, tok in (("drained", token_1), ("joined", token_1), ("joined", token_1 + 99)):
        await speak(
            watcher,
            subjects.HYBRID_STATE,
            ev.HybridState(worker_id="engine-1", state=state, fencing_token=tok, seconds=0.5),
            "rollout-engine",
        )
    key = role_changes_key(watcher.run_id)
    store = rig["store"]

    async def history() -> list[dict[str, Any]]:
        return [json.loads(x) for x in await store.r.lrange(key, 0, -1)]

    async with asyncio.timeout(5):
        while len(kept := await history()) < 5:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # the one under a stale token has had its chance
    kept = await history()
    assert [(h.get("from"), h.get("to"), h.get("state")) for h in kept] == [
        ("rollout", "draining", None),
        ("draining", "rollout", None),
        ("rollout", "hybrid", None),
        (None, None, "drained"),
        (None, None, "joined"),  # the one under a stale token is not kept
    ], kept
    assert [c["seconds"] is not None for c in role_changes(kept)] == [False, True, True]
    facts = await read_facts(watcher, subjects.FACTS_PLANNER, ev.PlannerFacts)  # what the report reads
    assert facts is not None and [json.loads(x) for x in facts.role_changes] == kept
    assert facts.role_changes_total == len(kept)


async def test_the_planner_moves_an_engine_into_training_when_rollout_idles_and_back_under_load(
    nats_server: Server, run_id: str, redis_server: Server
) -> None:
    """planner.hybrid: with the trainer's next batch waiting and the bucket's engines idle, the
    planner moves one engine (no more than `workers`, never the last) into training; the worker's
    steps move the policy along; when turns pile up it releases it, after its minimum stint."""
    cfg = RunConfig.model_validate(
        {
            "rollout": {"engines": 3, "max_batch": 4},
            "training": {"groups_per_step": 2},
            "job": {"lease_ttl_s": 60.0},
            "planner": {"hybrid": {"workers": 1, "hold_s": 0.3, "min_active_s": 0.5}},
        }
    )
    store = OwnershipStore.from_url(redis_server.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "planner", "planner")
    watcher = await Bus.connect(nats_server.url, run_id, "test", "watcher")
    plans = await _watch_plans(watcher)
    planner = PlannerService(PlannerSettings(tick_s=0.1), cfg, bus, store)
    await planner.start()
    try:
        for i in range(3):
            await speak(
                watcher,
                subjects.WORKER_HELLO,
                ev.WorkerHello(worker_id=f"engine-{i}", kind="rollout-engine", weight_sync_addr=f"x:{i}"),
            )
        await _until("plan", lambda: plans and len(plans[-1].assignments) == 3)
        idle = ev.WorkloadStats(queued_turns_by_bucket={"short": 0})
        await watcher.publish(subjects.WORKLOAD_STATS, idle)
        await watcher.publish(subjects.TRAIN_METRICS, ev.TrainMetrics(step=1, groups_ready=1))
        await asyncio.sleep(1.0)  # idle engines, but the trainer has no batch waiting: no move
        assert "hybrid" not in _roles(plans[-1]).values()

        await watcher.publish(subjects.TRAIN_METRICS, ev.TrainMetrics(step=2, groups_ready=3))
        await _until("join", lambda: "hybrid" in _roles(plans[-1]).values())
        moved = next(w for w, r in _roles(plans[-1]).items() if r == "hybrid")
        assert plans[-1].reason == f"hybrid_join:{moved}:rollout->hybrid"
        await asyncio.sleep(1.0)
        assert list(_roles(plans[-1]).values()).count("hybrid") == 1, "at most planner.hybrid.workers"
        token = next(a.fencing_token for a in plans[-1].assignments if a.worker_id == moved)
        for state in ("drained", "fetched", "joined"):
            await speak(
                watcher,
                subjects.HYBRID_STATE,
                ev.HybridState(worker_id=moved, state=state, fencing_token=token),
                "rollout-engine",
            )

        busy = ev.WorkloadStats(queued_turns_by_bucket={"short": 40})  # 5 turns per slot of 2 engines
        await watcher.publish(subjects.WORKLOAD_STATS, busy)
        await _until("release", lambda: _roles(plans[-1]).get(moved) == "rollout")
        assert plans[-1].reason == f"hybrid_release:{moved}:hybrid->rollout"
        async with asyncio.timeout(5):  # the plan goes out first, its history line right after
            while (
                len(kept := [json.loads(x) for x in await store.r.lrange(role_changes_key(run_id), 0, -1)])
                < 5
            ):
                await asyncio.sleep(0.05)
        assert [(h.get("to"), h.get("state")) for h in kept] == [
            ("hybrid", None),
            (None, "drained"),
            (None, "fetched"),
            (None, "joined"),
            ("rollout", None),
        ], kept
    finally:
        for b in (bus, watcher):
            await b.close()
        await store.close()


async def test_the_trainer_lends_its_gpus_engines_under_its_fencing_token(
    nats_server: Server, run_id: str, redis_server: Server
) -> None:
    """Engines past `rollout.engines` stand for the training GPUs: parked at the lent TP in the
    bucket of the nearest TP. The trainer holding the role lends them (`lent`) and takes them back
    (`parked`), each move under one plan and in the role history; a request under another token,
    or an unknown want, is refused with a typed error and changes nothing."""
    store = OwnershipStore.from_url(redis_server.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "planner", "planner")
    watcher = await Bus.connect(nats_server.url, run_id, "test", "watcher")
    plans = await _watch_plans(watcher)
    cfg = RunConfig.model_validate(
        {
            "rollout": {
                "engines": 2,
                "buckets": [
                    {"name": "short", "tensor_parallel": 1, "max_output_tokens": 100},
                    {"name": "long", "tensor_parallel": 8},
                ],
            },
            "planner": {"lending": {"engines": 2, "tensor_parallel": 4}},
        }
    )
    assert cfg.lending_bucket == "long" and cfg.engines_needed == 4
    planner = PlannerService(PlannerSettings(tick_s=0.1), cfg, bus, store)
    await planner.start()
    try:
        workers = ("engine-0", "engine-1", "engine-2", "engine-3", "trainer-a")
        for wid in workers:
            kind = "rollout-engine" if wid.startswith("engine") else "trainer"
            await speak(
                watcher,
                subjects.WORKER_HELLO,
                ev.WorkerHello(worker_id=wid, kind=kind, weight_sync_addr="x:1"),
            )
            await _until("registered", lambda wid=wid: plans and wid in _roles(plans[-1]))
        plan = plans[-1]
        assert _roles(plan) == {
            "engine-0": "rollout",
            "engine-1": "rollout",
            "engine-2": "parked",
            "engine-3": "parked",
            "trainer-a": "train",
        }
        parked = [a for a in plan.assignments if a.role == "parked"]
        assert {(a.bucket, a.tensor_parallel) for a in parked} == {("long", 4)}
        token = next(a.fencing_token for a in plan.assignments if a.role == "train")

        for bad in (
            ev.LendRequest(want="lend", fencing_token=token + 1),
            ev.LendRequest(want="everything", fencing_token=token),
        ):
            seen = len(plans)
            with pytest.raises(Refused, match="invalid"):
                await watcher.request(subjects.LEND_REQUEST, bad, ev.LendReply)
            await asyncio.sleep(0.3)
            assert len(plans) == seen

        lent = await watcher.request(
            subjects.LEND_REQUEST, ev.LendRequest(want="lend", fencing_token=token, step=3), ev.LendReply
        )
        assert list(lent.workers) == ["engine-2", "engine-3"]
        await _until("lent", lambda: plans[-1].plan_version >= lent.plan_version)
        assert [_roles(plans[-1])[w] for w in lent.workers] == ["lent", "lent"]
        assert plans[-1].reason.startswith("lend:engine-2,engine-3:parked->lent")
        again = await watcher.request(  # nothing parked any more: nothing moves
            subjects.LEND_REQUEST, ev.LendRequest(want="lend", fencing_token=token), ev.LendReply
        )
        assert list(again.workers) == [] and again.plan_version == lent.plan_version

        back = await watcher.request(
            subjects.LEND_REQUEST, ev.LendRequest(want="reclaim", fencing_token=token), ev.LendReply
        )
        assert list(back.workers) == ["engine-2", "engine-3"] and back.plan_version == lent.plan_version + 1
        await _until("parked", lambda: _roles(plans[-1])["engine-2"] == "parked")
        await speak(  # the engine handed its turns back
            watcher,
            subjects.HYBRID_STATE,
            ev.HybridState(
                worker_id="engine-2",
                state="parked",
                fencing_token=parked[0].fencing_token,
                turns_handed_back=3,
            ),
            "rollout-engine",
        )
        key = role_changes_key(run_id)
        async with asyncio.timeout(5):
            while len(await store.r.lrange(key, 0, -1)) < 5:
                await asyncio.sleep(0.05)
        changes = role_changes([json.loads(x) for x in await store.r.lrange(key, 0, -1)])
        assert [(c["worker"], c["from"], c["to"]) for c in changes] == [
            ("engine-2", "parked", "lent"),
            ("engine-3", "parked", "lent"),
            ("engine-2", "lent", "parked"),
            ("engine-3", "lent", "parked"),
        ]
        assert changes[2]["turns_handed_back"] == 3 and changes[2]["seconds"] is not None
        assert changes[3]["seconds"] is None  # engine-3 has not said it is parked yet
    finally:
        for b in (bus, watcher):
            await b.close()
            await b.nc.close()
        await store.close()


async def test_the_trainer_takes_its_gpus_back_one_switch_before_its_batch_is_forecast(
    nats_server: Server, run_id: str, redis_server: Server
) -> None:
    """The trainer's Lender (its real membership, the real planner): with nothing forecast yet it
    lends its GPUs' engines; as groups complete one every four switches, it takes them back by
    itself one switch before the last group of the batch is due (an early reclaim, the engines
    parked again under one plan), and does not lend them again for a batch that is that close."""
    from services.common.membership import Membership
    from services.trainer.lending import Lender

    store = OwnershipStore.from_url(redis_server.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "planner", "planner")
    tbus = await Bus.connect(nats_server.url, run_id, "trainer", "trainer-a")
    watcher = await Bus.connect(nats_server.url, run_id, "test", "watcher")
    plans = await _watch_plans(watcher)
    cfg = RunConfig.model_validate(
        {
            "rollout": {
                "engines": 1,
                "backend": "emulated",
                "emulated": {"time_scale": 0.02},
                "buckets": [{"name": "all", "tensor_parallel": 4}],
            },
            "training": {"backend": "emulated", "groups_per_step": 4},
            "planner": {"lending": {"engines": 1, "tensor_parallel": 4, "policy": "predictive"}},
        }
    )
    planner = PlannerService(PlannerSettings(tick_s=0.1), cfg, bus, store)
    await planner.start()
    membership = Membership(tbus, store, ev.WorkerHello(worker_id="trainer-a", kind="trainer"))
    watching: asyncio.Task[None] | None = None
    try:
        await membership.start()
        for wid in ("engine-0", "engine-1"):
            await speak(watcher, subjects.WORKER_HELLO, ev.WorkerHello(worker_id=wid, kind="rollout-engine"))
        await _until("parked", lambda: plans and _roles(plans[-1]).get("engine-1") == "parked")
        await membership.wait_assigned(15.0)
        await _until("follows", lambda: membership.peers("parked"))
        assert membership.assignment is not None
        token = membership.assignment.fencing_token
        lender = Lender(
            cfg.planner.lending,
            lending.switch_s(cfg),
            lending.lent_share(cfg),
            cfg.training.groups_per_step,
            tbus,
            membership,
            lambda: token,
            lambda: 0,
            lambda: None,
            timeout_s=5.0,
        )
        assert 0.1 < lender.switch_s < 1.0, lender.switch_s  # the cost model's switch, time-scaled
        ready = [0]
        watching = asyncio.create_task(lender.watch(lambda: ready[0], every_s=0.01))
        await lender.waiting(0)
        assert lender.lends == 1 and lender.lent_at is not None
        await _until("lent", lambda: _roles(plans[-1])["engine-1"] == "lent")
        for i in (1, 2, 3):  # of the 4 the step needs
            await asyncio.sleep(4 * lender.switch_s)
            assert lender.lent_at is not None, f"taken back before group {i} completed"
            ready[0] = i
            lender.group_complete(f"g{i}", time.time())
            lender.group_complete(f"g{i}", time.time() + 1.0)  # redelivered: heard of once
        await _until("reclaimed", lambda: lender.lent_at is None, timeout=8 * lender.switch_s + 5)
        assert ready[0] == 3 and lender.reclaims == lender.early_reclaims == 1
        await _until("parked again", lambda: _roles(plans[-1])["engine-1"] == "parked")
        await lender.waiting(3)
        assert lender.lends == 1, "the batch is forecast within a switch: no lending for it"
    finally:
        if watching is not None:
            watching.cancel()
        for b in (bus, tbus, watcher):
            await b.close()
        await store.close()


async def test_the_planner_relays_out_engines_when_the_lengths_drift_and_keeps_their_gpus(
    nats_server: Server, run_id: str, redis_server: Server
) -> None:
    """With `planner.relayout`, lengths that outgrew the layout (8 TP1 short engines, 4 TP2 long
    ones, 16 GPUs) make the planner move engines between buckets and change the buckets' TP under
    one plan, recorded as role changes (`why: relayout`), leaving spare the engines whose GPUs went
    to bigger ones: the GPUs the engines stand for stay 16. A restarted planner continues the
    layout; the same stats again find nothing better."""
    from services.common.membership import SPARE_ROLE

    cfg = RunConfig.model_validate(
        {
            "rollout": {
                "engines": 12,
                "backend": "emulated",
                "max_batch": 16,
                "buckets": [
                    {"name": "short", "engines": 8, "max_output_tokens": 500},
                    {"name": "long", "engines": 4, "tensor_parallel": 2},
                ],
            },
            "training": {"groups_per_step": 16},
            "task": {"max_context_tokens": 40960},
            "job": {"lease_ttl_s": 60.0},
            "planner": {
                "interval_s": 0.3,
                "cooldown_s": 0.0,
                "min_samples": 32,
                "relayout": True,
                "what_if": {"budget_s": 30.0},  # as above: the simulation chooses, however loaded
            },
        }
    )
    store = OwnershipStore.from_url(redis_server.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "planner", "planner")
    watcher = await Bus.connect(nats_server.url, run_id, "test", "watcher")
    plans = await _watch_plans(watcher)
    changes: list[ev.RoleChange] = []

    async def on_change(m: ev.RoleChange, _: Envelope) -> None:
        changes.append(m)

    await watcher.subscribe(subjects.ROLE_CHANGE, ev.RoleChange, on_change)
    planner = PlannerService(PlannerSettings(tick_s=0.1), cfg, bus, store)
    await planner.start()

    def gpus(plan: ev.Plan) -> int:
        tp = {b.name: b.tensor_parallel for b in plan.buckets}
        return sum(
            tp[a.bucket] if a.role == "rollout" else a.tensor_parallel
            for a in plan.assignments
            if a.role in ("rollout", SPARE_ROLE)
        )

    try:
        await _hello_engines(watcher, [f"engine-{i:02d}" for i in range(12)])
        await _until("plan", lambda: plans and len(plans[-1].assignments) == 12)
        first = plans[-1]
        assert gpus(first) == 16
        rng = random.Random(0)
        stats = ev.WorkloadStats(
            trajectory_output_tokens=[int(rng.lognormvariate(9.0, 0.8)) for _ in range(256)],  # ~8000
            tool_s_per_turn=5.0,
            prompt_tokens=2000,
            turns_per_trajectory_mean=6,
        )
        await watcher.publish(subjects.WORKLOAD_STATS, stats)
        await _until("relayout", lambda: "relayout" in plans[-1].reason)
        plan = plans[-1]
        assert plan.reason.startswith("replan:") and plan.predicted_gain > 0.03
        record = json.loads((await store.r.lrange(plans_key(run_id), -1, -1))[0])
        assert record["decision"]["scored_by"] == "simulation", "the re-layout was chosen by simulating it"
        best = max(record["decision"]["candidates"], key=lambda c: c["trajectories_per_s"])
        assert best["label"].startswith("relayout:")
        before = {a.worker_id: (a.role, a.bucket) for a in first.assignments}
        after = {a.worker_id: (a.role, a.bucket) for a in plan.assignments}
        tps = [(b.name, b.tensor_parallel) for b in plan.buckets]
        assert after != before or tps != [("short", 1), ("long", 2)], (
            "the layout changed, not only thresholds"
        )
        assert gpus(plan) == 16, "the engines stand for the GPUs they had"
        assert all(r in ("rollout", SPARE_ROLE) for r, _ in after.values())
        assert all(
            n >= 1 for n in (sum(a == ("rollout", b) for a in after.values()) for b in ("short", "long"))
        )
        await _until("events", lambda: changes)
        history = [json.loads(x) for x in await store.r.lrange(role_changes_key(run_id), 0, -1)]
        moved = {h["worker"] for h in history if h.get("why") == "relayout"}
        assert moved and moved == {c.worker_id for c in changes}
        assert {w for w in after if after[w] != before[w]} <= moved

        # an engine that restarts (the same id at a new address) goes back where the layout has
        # it, spare or in its bucket, with a new lease: the GPUs stay what they were
        spare = next(w for w, (r, _) in after.items() if r == SPARE_ROLE)
        serving = next(w for w, (r, _) in after.items() if r == "rollout")
        seen = len(plans)
        for wid in (spare, serving):
            await speak(
                watcher,
                subjects.WORKER_HELLO,
                ev.WorkerHello(worker_id=wid, kind="rollout-engine", weight_sync_addr=f"restarted:{wid}"),
            )
        await _until(
            "restarts",
            lambda: (
                len(plans) > seen
                and {a.weight_sync_addr for a in plans[-1].assignments}
                >= {f"restarted:{spare}", f"restarted:{serving}"}
            ),
        )
        assert {a.worker_id: (a.role, a.bucket) for a in plans[-1].assignments} == after
        assert gpus(plans[-1]) == 16
        plan = plans[-1]

        # a restarted planner continues the layout, and finds nothing better in the same stats
        await bus.close()  # the planner's loop with it
        bus = await Bus.connect(nats_server.url, run_id, "planner", "planner")
        await store.r.delete(f"libra:{run_id}:lease:planner")
        again = PlannerService(PlannerSettings(tick_s=0.1), cfg, bus, store)
        await again.start()
        await _until("continued", lambda: plans[-1].planner_epoch > plan.planner_epoch)
        assert {a.worker_id: (a.role, a.bucket) for a in plans[-1].assignments} == after
        assert [(b.name, b.tensor_parallel) for b in plans[-1].buckets] == tps
        seen = len(changes)
        await watcher.publish(subjects.WORKLOAD_STATS, stats)
        await asyncio.sleep(1.0)
        assert len(changes) == seen, "the layout is already the best for these lengths"
    finally:
        for b in (bus, watcher):
            await b.close()
            await b.nc.close()
        await store.close()


# Nobody renews engine-0's lease here: one that lapsed mid-test would be a second change.
@pytest.mark.parametrize("rig", [60.0], indirect=True)
async def test_one_change_goes_out_as_one_plan_however_many_publish_it_at_once(rig: dict[str, Any]) -> None:
    """A role move and the planner's tick that both find the plan changed publish it once: one new
    version, one line in the plan history; a change made while that plan goes out is the next."""
    planner, plans, store, watcher = rig["planner"], rig["plans"], rig["store"], rig["watcher"]
    await _hello_engines(watcher, ["engine-0"])
    await _until("registered", lambda: plans and "engine-0" in _roles(plans[-1]))
    await asyncio.sleep(0.3)  # the tick has nothing more to publish
    state, before = planner.state, planner.state.version
    kept = await store.r.llen(plans_key(store.run_id))

    state.changed("test:once")
    results = await asyncio.gather(*(planner.publisher.publish() for _ in range(4)))
    assert results == [True] * 4 and state.version == before + 1 and not state.dirty
    await _until("out", lambda: plans[-1].plan_version == before + 1)
    assert plans[-1].reason == "test:once"
    assert await store.r.llen(plans_key(store.run_id)) == kept + 1

    first = asyncio.ensure_future(planner.publisher.publish())
    await asyncio.sleep(0)  # the first publication has taken the plan as it stood
    state.changed("test:while_out")
    assert await first
    await _until("next", lambda: plans[-1].reason == "test:while_out")
    await asyncio.sleep(0.5)  # ticks meanwhile: nothing more to publish
    out = [p for p in plans if p.plan_version > before]
    assert [p.plan_version for p in out] == list(range(before + 1, before + 1 + len(out)))
    assert [p.reason for p in out].count("test:while_out") == 1 and out[-1].reason == "test:while_out"
