"""Which scheduler acts (services/scheduler/leadership.py), as pure logic: the plan's assignment and
the lease's clock checked locally, Redis asked only when unsure. A fake membership and lease store
stand in for the plan and Redis (the e2e test runs the real ones)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
import structlog

from services.common.contracts import ev
from services.common.errors import FencedOut
from services.common.ownership import Lease
from services.scheduler.leadership import Leadership


@dataclass
class FakeMembership:
    assignment: ev.Assignment | None = None
    valid: bool = True
    hello: ev.WorkerHello = field(default_factory=lambda: ev.WorkerHello(worker_id="scheduler"))

    def holds_lease(self) -> bool:
        return self.assignment is not None and self.valid

    def retaken(self, token: int) -> None:
        """As `Membership.retaken`: the assignment takes the token Redis holds, renewed at once."""
        assert self.assignment is not None
        self.assignment = _assign(self.assignment.role, token)
        self.valid = True

    def adopt(self, role: str, token: int) -> None:
        """As `Membership.adopt`: the role and token Redis shows, renewed at once."""
        self.assignment = _assign(role, token)
        self.valid = True


class FakeStore:
    """The role lease: held by `owner` under `current_token` (0: nobody holds it)."""

    def __init__(self) -> None:
        self.current_token = 0
        self.owner = "scheduler"
        self.down = False
        self.asked = 0

    async def holder(self, resource: str) -> Lease | None:
        self.asked += 1
        if self.down:
            raise ConnectionError("redis away")
        return Lease(resource, self.owner, self.current_token) if self.current_token else None

    async def is_current(self, resource: str, token: int) -> bool:
        held = await self.holder(resource)
        return held is not None and held.token == token


def _leadership() -> tuple[Leadership, FakeMembership, FakeStore]:
    m, s = FakeMembership(), FakeStore()
    return Leadership(m, s, structlog.get_logger()), m, s  # type: ignore[arg-type]


def _assign(role: str, token: int) -> ev.Assignment:
    return ev.Assignment(worker_id="scheduler", role=role, fencing_token=token)


async def test_a_standby_waits_until_the_plan_gives_it_the_role_and_redis_confirms_it() -> None:
    lead, m, store = _leadership()
    stop = asyncio.Event()
    m.assignment = _assign("standby", 3)
    waiting = asyncio.ensure_future(lead.wait_for_role(stop))
    await asyncio.sleep(0.3)
    assert not waiting.done() and not lead.acting()
    m.assignment = _assign("schedule", 4)  # promoted, but Redis does not hold token 4 yet
    await asyncio.sleep(0.3)
    assert not waiting.done()
    store.current_token = 4
    assert await asyncio.wait_for(waiting, 2) is True
    assert lead.token == 4 and lead.acting()
    await lead.require()  # acting: writes go ahead


async def test_a_standby_that_redis_shows_holding_the_role_takes_it_before_the_plan_says_so() -> None:
    """The planner leases the role, then publishes the plan; at a thousand engines the plan came
    seconds late. The standby asks Redis while it waits and takes the role under Redis's token;
    a role Redis shows for another scheduler is not taken."""
    lead, m, store = _leadership()
    stop = asyncio.Event()
    m.assignment = _assign("standby", 3)
    store.owner, store.current_token = "scheduler-other", 7  # another holds it: stand by
    waiting = asyncio.ensure_future(lead.wait_for_role(stop))
    await asyncio.sleep(0.5)
    assert not waiting.done() and m.assignment.role == "standby"
    store.owner, store.current_token = "scheduler", 8  # promoted: no plan says so yet
    assert await asyncio.wait_for(waiting, 2) is True
    assert lead.token == 8 and lead.acting() and m.assignment.role == "schedule"


async def test_a_stopped_job_ends_the_wait() -> None:
    lead, m, _ = _leadership()
    m.assignment = _assign("standby", 1)
    stop = asyncio.Event()
    stop.set()
    assert await lead.wait_for_role(stop) is False


async def test_writes_wait_while_the_lease_is_unconfirmed_and_are_refused_once_another_holds_it() -> None:
    lead, m, store = _leadership()
    m.assignment, store.current_token = _assign("schedule", 2), 2
    assert await lead.wait_for_role(asyncio.Event())
    m.valid = False  # paused past its lease: the local clock says so, before any Redis call
    write = asyncio.ensure_future(lead.require())
    await asyncio.sleep(0.5)
    assert not write.done()  # nothing written while unsure
    store.current_token, store.owner = 3, "scheduler-standby-0"  # a standby took the role
    with pytest.raises(FencedOut):
        await asyncio.wait_for(write, 2)
    assert lead.fenced.is_set()


async def test_each_tick_skips_while_unsure_and_fences_once_another_scheduler_holds_the_role() -> None:
    lead, m, store = _leadership()
    m.assignment, store.current_token = _assign("schedule", 2), 2
    assert await lead.wait_for_role(asyncio.Event())
    asked = store.asked
    assert await lead.still_leading() and store.asked == asked  # acting: no Redis call
    m.valid = False
    store.down = True
    assert not await lead.still_leading() and not lead.fenced.is_set()  # Redis away: wait
    store.down = False
    assert not await lead.still_leading() and not lead.fenced.is_set()  # still its token: wait
    store.current_token = 0
    assert not await lead.still_leading() and not lead.fenced.is_set()  # lapsed, nobody has it
    store.current_token, store.owner = 3, "scheduler-standby-0"
    assert not await lead.still_leading() and lead.fenced.is_set()


async def test_a_lapsed_lease_leased_again_to_the_same_scheduler_is_taken_up() -> None:
    """Its renewals late past the lease (a busy loop, a slow Redis), the planner leased the role
    to it again: nobody held it in between (the token moved by one), so it carries on, its
    writes waiting meanwhile; a token further on was someone else's in between, and fences."""
    lead, m, store = _leadership()
    m.assignment, store.current_token = _assign("schedule", 2), 2
    assert await lead.wait_for_role(asyncio.Event())
    m.valid = False
    write = asyncio.ensure_future(lead.require())
    await asyncio.sleep(0.3)
    store.current_token = 3  # re-leased to this scheduler; the plan saying so has not come yet
    await asyncio.wait_for(write, 2)
    assert lead.token == 3 and lead.acting() and not lead.fenced.is_set()
    assert m.assignment is not None and m.assignment.fencing_token == 3  # renewed under 3 meanwhile
    m.valid = False
    store.current_token = 5  # its own again, but token 4 was someone's in between
    assert not await lead.still_leading() and lead.fenced.is_set()


async def test_a_plan_that_moves_the_role_elsewhere_stops_it_acting() -> None:
    lead, m, store = _leadership()
    m.assignment, store.current_token = _assign("schedule", 2), 2
    assert await lead.wait_for_role(asyncio.Event())
    m.assignment = _assign("standby", 5)
    assert not lead.acting()
    store.current_token = 6
    assert not await lead.still_leading() and lead.fenced.is_set()


def test_nothing_acts_before_it_took_the_role() -> None:
    lead, m, _ = _leadership()
    m.assignment = _assign("schedule", 1)
    assert not lead.acting()  # the role in the plan is not enough: wait_for_role confirms it
