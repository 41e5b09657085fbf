"""Which of a job's schedulers acts: the one the plan gives the `schedule` role, under the role's
lease (`SCHEDULER_ROLE`). Further schedulers stand by, warm (connected, tokenizer loaded, the plan
followed), and the planner gives one of them the role when the holder's lease runs out (killed,
paused, cut off); it resumes from the ledger as a restarted scheduler does.

The scheduler that held the role writes only while its lease is surely its own: renewed less than
a lease ago (`Membership.holds_lease`, a local clock check that needs no Redis round trip), for the
token it acts under. A scheduler paused past its lease wakes with that check false and writes
nothing more to the ledger or the trainer's stream until Redis confirms the role; once another
scheduler holds it, it is fenced out (`FencedOut`) and its job starts over in the same process,
as a standby.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from services.common.errors import FencedOut
from services.common.membership import SCHEDULER_ROLE, Membership, leased_again
from services.common.ownership import OwnershipStore

ROLE = "schedule"
POLL_S = 0.2


class Leadership:
    def __init__(self, membership: Membership, store: OwnershipStore, log: Any):
        self.membership, self.store, self.log = membership, store, log
        self.token = 0
        """The role lease's fencing token this scheduler acts under (0: it has not taken the role)."""
        self.fenced = asyncio.Event()
        """Set when another scheduler holds the role: `serve` ends the job with `FencedOut`."""

    async def wait_for_role(self, stop: asyncio.Event) -> bool:
        """Stands by until the plan gives this scheduler the role and Redis confirms its lease
        (False: the job stopped first)."""
        standing_by = False
        while not stop.is_set():
            a = self.membership.assignment
            if a is not None and a.role == ROLE and self.membership.holds_lease():
                if await self._current(a.fencing_token):
                    self.token = a.fencing_token
                    self.log.info("scheduler_leading", fencing_token=self.token)
                    return True
            elif a is not None:
                if not standing_by:
                    standing_by = True
                    self.log.info("scheduler_standing_by", role=a.role)
                await self._leased_before_plan()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)
        return False

    async def _leased_before_plan(self) -> None:
        """The planner leases the role to a standby before it publishes the plan saying so, and at a
        thousand engines that plan reached a standby up to 14 s late: a standby that Redis shows
        holding the role takes it up now (`Membership.adopt`)."""
        try:
            held = await self.store.holder(SCHEDULER_ROLE)
        except Exception:  # Redis away: the plan will say
            return
        if held is not None and held.owner == self.membership.hello.worker_id:
            self.membership.adopt(ROLE, held.token)

    def acting(self) -> bool:
        """The role is this scheduler's under its token, its lease renewed less than a lease ago."""
        a = self.membership.assignment
        return (
            self.token > 0
            and a is not None
            and a.role == ROLE
            and a.fencing_token == self.token
            and self.membership.holds_lease()
        )

    async def require(self) -> None:
        """Before a write the job keeps (the ledger, a trajectory for the trainer): goes ahead while
        acting. While the lease is not confirmed (a renewal late, Redis slow, the lease lapsed with
        nobody else holding the role) it waits, writing nothing; once another scheduler holds the
        role it raises `FencedOut`: what this process holds is re-issued from the ledger."""
        while not self.acting():
            if not self.fenced.is_set():
                await self.still_leading()
                if self.acting():
                    return
            if self.fenced.is_set():
                raise FencedOut("another scheduler holds the role: writes refused")
            await asyncio.sleep(POLL_S)

    async def still_leading(self) -> bool:
        """Each tick: True while acting. False to skip the tick while unsure; fenced out once Redis
        says another scheduler holds the role. A lease that lapsed (its renewals late: a loop
        or a Redis busy past the lease) and that the planner leased to this same scheduler again
        is taken up under the new token when nobody held the role in between (the fencing
        counter moved by one): at a thousand engines on a busy machine lapses happen, and
        restarting the job's scheduler for each would cost every trajectory in flight."""
        if self.acting():
            return True
        if self.fenced.is_set():
            return False
        try:
            held = await self.store.holder(SCHEDULER_ROLE)
        except Exception as err:  # Redis away: act on nothing until it answers
            self.log.warning("scheduler_lease_unconfirmed", error=f"{type(err).__name__}: {err}")
            return False
        if held is None or held.token == self.token:
            return False  # lapsed with nobody holding it, or a renewal late: wait
        if leased_again(held, self.membership.hello.worker_id, self.token):
            self.log.warning("scheduler_lease_retaken", old_token=self.token, fencing_token=held.token)
            self.token = held.token
            self.membership.retaken(held.token)
            return self.acting()
        self.fence(f"{held.owner} holds the role under token {held.token}")
        return False

    def fence(self, why: str) -> None:
        if not self.fenced.is_set():
            self.log.warning("scheduler_fenced_out", fencing_token=self.token, reason=why)
            self.fenced.set()

    async def _current(self, token: int) -> bool:
        """Whether Redis holds the role lease under `token`."""
        try:
            return bool(await self.store.is_current(SCHEDULER_ROLE, token))
        except Exception as err:
            self.log.warning("scheduler_lease_unconfirmed", error=f"{type(err).__name__}: {err}")
            return False
