import asyncio
from typing import Any

import pytest

from services.common.contracts import ev
from services.common.membership import SCHEDULER_ROLE, TRAINER_ROLE, Membership
from services.common.ownership import OwnershipStore

pytestmark = pytest.mark.integration


async def test_leases_are_exclusive_fenced_and_expire(redis_server, run_id) -> None:
    store = OwnershipStore.from_url(redis_server.url, run_id)
    try:
        a = await store.acquire("role:trainer", "w1", ttl_s=0.3)
        assert a is not None and a.token == 1
        assert await store.acquire("role:trainer", "w2", ttl_s=5) is None  # held by w1
        assert await store.is_current("role:trainer", a.token)
        assert await store.renew(a, ttl_s=0.3)
        await asyncio.sleep(0.5)  # w1 stops renewing: its lease expires
        assert not await store.is_current("role:trainer", a.token)
        assert not await store.renew(a, ttl_s=5)  # too late: the lease is gone
        b = await store.acquire("role:trainer", "w2", ttl_s=5)
        assert b is not None and b.token > a.token  # fencing tokens only grow
        assert not await store.is_current("role:trainer", a.token)
        assert not await store.release(a)  # a stale holder cannot release the new lease
        assert await store.release(b)
        assert await store.holder("role:trainer") is None
    finally:
        await store.close()


async def test_reacquire_by_same_owner_issues_new_token(redis_server, run_id) -> None:
    store = OwnershipStore.from_url(redis_server.url, run_id)
    try:
        first = await store.acquire("worker:e0", "e0", ttl_s=5)
        again = await store.acquire("worker:e0", "e0", ttl_s=5)
        assert first is not None and again is not None and again.token == first.token + 1
        assert not await store.is_current("worker:e0", first.token)
    finally:
        await store.close()


async def test_commit_record_is_written_only_under_the_current_token(redis_server, run_id) -> None:
    from services.common.ownership import committed_key, trained_key

    store = OwnershipStore.from_url(redis_server.url, run_id)
    try:
        a = await store.acquire("role:trainer", "t1", ttl_s=5)
        assert a is not None
        assert await store.fenced_commit("role:trainer", a.token, {"step": 1, "version": 1}, {"x", "y"})
        assert await store.r.hgetall(committed_key(run_id)) == {"step": "1", "version": "1"}
        await store.release(a)
        b = await store.acquire("role:trainer", "t2", ttl_s=5)
        assert b is not None
        # the old holder (paused past its lease, say) commits nothing, not even its ids
        assert not await store.fenced_commit("role:trainer", a.token, {"step": 9, "version": 9}, {"z"})
        assert await store.r.hgetall(committed_key(run_id)) == {"step": "1", "version": "1"}
        assert await store.r.smembers(trained_key(run_id)) == {"x", "y"}
        assert await store.fenced_commit("role:trainer", b.token, {"step": 2, "version": 2}, {"y", "w"})
        record = await store.committed()
        assert record["step"] == "2" and record["trained_twice"] == "1"  # "y" was trained before
    finally:
        await store.close()


async def _renewing(store: OwnershipStore, lease_ttl_s: float, worker: str, token: int) -> Membership:
    """A worker following a plan that gives it the trainer role under `token`, its lease renewing."""
    unused: Any = None  # renewing reads the store only
    m = Membership(unused, store, ev.WorkerHello(worker_id=worker, kind="trainer"))
    plan = ev.Plan(plan_version=1, planner_epoch=1, lease_ttl_s=lease_ttl_s)
    plan.assignments.add(worker_id=worker, role="train", fencing_token=token)
    await m._apply(plan)
    return m


async def test_a_lapsed_lease_leased_again_to_its_worker_is_taken_up_before_the_plan_says_so(
    redis_server, run_id
) -> None:
    """A renewal comes too late, the planner leases the role to the same worker again (token + 1):
    the worker renews under the new token at once rather than waiting for the plan naming it. A
    lease another worker took meanwhile is lost, not taken."""
    store = OwnershipStore.from_url(redis_server.url, run_id)
    renewing: list[asyncio.Task[None]] = []
    try:
        first = await store.acquire(TRAINER_ROLE, "trainer-a", ttl_s=5)
        assert first is not None
        m = await _renewing(store, 1.0, "trainer-a", first.token)
        renewing.append(asyncio.create_task(m._renew_loop()))
        await asyncio.sleep(0.3)
        assert m.holds_lease()
        await store.r.delete(store._key(TRAINER_ROLE))  # lapsed: its renewals were late
        again = await store.acquire(TRAINER_ROLE, "trainer-a", ttl_s=5)  # the planner re-leases it
        assert again is not None and again.token == first.token + 1
        async with asyncio.timeout(5):
            while m.assignment is None or m.assignment.fencing_token != again.token:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert m.holds_lease() and m.lease_lost == 0
        assert await store.is_current(TRAINER_ROLE, again.token)

        await store.r.delete(store._key(TRAINER_ROLE))
        other = await store.acquire(TRAINER_ROLE, "trainer-b", ttl_s=5)  # the standby's now
        assert other is not None and other.token == again.token + 1
        async with asyncio.timeout(5):
            while m.lease_lost == 0:
                await asyncio.sleep(0.05)
        assert not m.holds_lease() and m.assignment is not None
        assert m.assignment.fencing_token == again.token
        assert await store.holder(TRAINER_ROLE) == other
    finally:
        for t in renewing:
            t.cancel()
        await store.close()


async def test_a_standby_leased_the_role_before_the_plan_says_so_renews_it_and_keeps_it(
    redis_server, run_id
) -> None:
    """A standby that Redis shows holding the scheduler role (the planner leased it, its plan not
    here yet) takes the role and token now and renews that lease; a plan from before, naming it
    standby, does not take the role back; the plan naming the role ends the wait for it."""
    store = OwnershipStore.from_url(redis_server.url, run_id)
    unused: Any = None  # renewing reads the store only
    m = Membership(unused, store, ev.WorkerHello(worker_id="scheduler-b", kind="scheduler"))
    renewing = None
    try:
        standby = await store.acquire("worker:scheduler-b", "scheduler-b", ttl_s=1.0)
        assert standby is not None
        old = ev.Plan(plan_version=1, planner_epoch=1, lease_ttl_s=1.0)
        old.assignments.add(worker_id="scheduler-b", role="standby", fencing_token=standby.token)
        await m._apply(old)
        renewing = asyncio.create_task(m._renew_loop())
        lease = await store.acquire(SCHEDULER_ROLE, "scheduler-b", ttl_s=1.0)  # promoted
        assert lease is not None
        m.adopt("schedule", lease.token)
        await m._apply(old)  # the plan from before comes again (a late delivery, a re-read)
        await asyncio.sleep(2.5)  # 2.5 leases: renewed under the role's token all along
        assert m.assignment is not None and (m.assignment.role, m.assignment.fencing_token) == (
            "schedule",
            lease.token,
        )
        assert m.holds_lease() and m.lease_lost == 0 and await store.is_current(SCHEDULER_ROLE, lease.token)
        new = ev.Plan(plan_version=2, planner_epoch=1, lease_ttl_s=1.0)
        new.assignments.add(worker_id="scheduler-b", role="schedule", fencing_token=lease.token)
        await m._apply(new)
        moved = ev.Plan(plan_version=3, planner_epoch=1, lease_ttl_s=1.0)  # the planner moves it on
        moved.assignments.add(worker_id="scheduler-b", role="standby", fencing_token=9)
        await m._apply(moved)
        assert m.assignment.role == "standby" and m.assignment.fencing_token == 9
    finally:
        if renewing is not None:
            renewing.cancel()
        await store.close()


async def test_the_holders_of_many_leases_read_in_one_go_are_each_ones_holder(redis_server, run_id) -> None:
    store = OwnershipStore.from_url(redis_server.url, run_id)
    try:
        a = await store.acquire("worker:a", "a", ttl_s=5)
        b = await store.acquire(TRAINER_ROLE, "t", ttl_s=5)
        assert a is not None and b is not None
        resources = ["worker:a", "worker:nobody", TRAINER_ROLE]
        assert await store.holders(resources) == [await store.holder(r) for r in resources]
        assert await store.holders(resources) == [a, None, b]
        assert await store.holders([]) == []
    finally:
        await store.close()
