"""Whether this trainer acts for the job, and the job's progress it answers to: the trainer lease
(current in Redis under its fencing token), the epoch under which it adopted the commit record, and
the commit record itself — written fenced after each step, read back to roll a trainer back (or a
standby forward) to the step the job has committed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.errors import DurableStateLost
from services.common.facts import FactsOut
from services.common.logging import get_logger
from services.common.membership import TRAINER_ROLE, Membership
from services.common.ownership import OwnershipStore
from services.common.tasks import retried, retry_pause
from services.trainer.hybrid_host import HybridHost

if TYPE_CHECKING:
    from services.learning.learner import Learner


class Leadership:
    def __init__(
        self,
        bus: Bus,
        store: OwnershipStore,
        membership: Membership,
        learner: Learner,
        hybrid: HybridHost,
        rolled_back: Callable[[], None],
        model_owned: Callable[[], AbstractAsyncContextManager[None]] = contextlib.nullcontext,
    ):
        self.bus, self.store, self.membership = bus, store, membership
        self.learner, self.hybrid = learner, hybrid
        self.rolled_back = rolled_back
        """Called after a roll-back: what was derived from the dropped weights goes too."""
        self.model_owned = model_owned
        """Held while the learner's weights are restored: nothing else reads the model meanwhile
        (the trainer's own engine, planner.lending.trainer_serves, hands its turns back first)."""
        self.log = get_logger(component="trainer")
        self.leader: bool | None = None
        """The lease was current at the last check (None: not checked yet)."""
        self.epoch = -1
        """The fencing token under which this trainer last adopted the commit record."""
        self.facts = FactsOut(bus, subjects.FACTS_TRAINER)
        """The commit record as the job's report reads it (services/common/facts.py)."""

    @property
    def token(self) -> int:
        a = self.membership.assignment
        return a.fencing_token if a is not None else 0

    @property
    def leading(self) -> bool:
        """Acts for the job: its lease was current and it adopted the record under this token."""
        return bool(self.leader) and self.epoch == self.token

    async def holds(self) -> bool:
        """Holds the trainer lease, and Redis says it is still current."""
        if not self.membership.holds_lease():
            return False
        try:
            ok = await self.store.is_current(TRAINER_ROLE, self.token)
        except Exception as err:  # Redis unreachable: keep the loop alive, try again next round
            self.log.warning("lease_check_failed", error=str(err))
            return False
        if ok != self.leader:
            self.log.log(
                20 if ok else 30, "lease_current" if ok else "lease_not_current", fencing_token=self.token
            )
            self.leader = ok
        return ok

    async def adopt(self, stop: asyncio.Event) -> bool:
        """In a new epoch (first assignment, a restart, a takeover) the job's progress is the commit
        record's: loads the checkpoint it names unless that is what this trainer holds (checkpoints
        the record does not cover are not the job's). Waits out a Redis outage; False if stopped."""
        token = self.token
        if token == self.epoch:
            return True
        record = await retried(self.store.committed, self.log, "commit_record_unreadable", stop=stop)
        if record is None:
            return False
        step, named = int(record.get("step", 0)), record.get("checkpoint", "")
        if step > 0 and named and not Path(named).exists():
            raise DurableStateLost(
                f"the commit record says step {step} is committed in {named}, which is not there (the "
                "checkpoint directory was lost, or is not shared with this trainer): not training on "
                "from older weights"
            )
        holds = self.learner.state.step == step and (
            not named or (self.learner.loaded is not None and str(self.learner.loaded) == named)
        )
        if not holds:
            await self.roll_back(record)
        self.epoch = token
        if step > 0:
            self.facts.update(trainer_facts(record))
        return True

    async def roll_back(self, record: dict[str, str] | None = None) -> None:
        """Back to (or, for a standby taking over, on to) the step the job's commit record holds."""
        try:
            record = record if record is not None else await self.store.committed()
        except Exception as err:
            self.log.error("rollback_failed", error=str(err))
            return
        step, named = int(record.get("step", 0)), record.get("checkpoint", "")
        await self.hybrid.close()  # its members hold weights this trainer is about to drop
        async with self.model_owned():
            path = await asyncio.to_thread(self.learner.rollback, step, named)
        self.rolled_back()
        self.log.warning(
            "rolled_back",
            step=self.learner.state.step,
            checkpoint=str(path or "initial weights"),
            optimizer_state=str(self.learner.optimizer_from or "fresh") if path else "fresh",
        )

    async def record_commit(self, ids: set[str], checkpoint: str, stop: asyncio.Event | None = None) -> bool:
        """Records the committed step in Redis (the job's authoritative progress) under the lease.

        False when the lease moved on: this trainer must not ack what it trained. Redis away is
        waited out (with a backoff of at most 5 s): nothing is acked before the record holds the
        step; stopping meanwhile counts as not committed, and the step is rolled back.
        """
        state = self.learner.state
        token = self.token
        record: dict[str, str | int] = {
            "step": state.step,
            "version": state.version,
            "checkpoint": checkpoint,
            "trained": len(state.trained_ids),
            "worker_id": self.bus.worker_id,
            "fencing_token": token,
        }
        attempt = 0
        while True:
            try:
                if attempt and await self._already_committed(state.step, token):
                    return True  # the earlier attempt reached Redis; only its answer was lost
                ok = await self.store.fenced_commit(TRAINER_ROLE, token, record, ids)
                break
            except Exception as err:
                attempt += 1
                self.log.warning("commit_record_failed", error=str(err), attempt=attempt)
                if stop is not None and stop.is_set():
                    return False
                await retry_pause(attempt)
        if not ok:
            self.log.error("commit_refused", step=state.step, fencing_token=token, reason="lease lost")
            return False
        try:  # read back: the commit script counted the ids trained twice
            self.facts.update(trainer_facts(await self.store.committed()))
        except Exception as err:  # the next commit (or a new leader's adoption) publishes it
            self.log.warning("commit_record_unreadable", error=str(err))
        return True

    async def _already_committed(self, step: int, token: int) -> bool:
        record = await self.store.committed()
        return record.get("step") == str(step) and record.get("fencing_token") == str(token)


def trainer_facts(record: dict[str, str]) -> ev.TrainerFacts:
    """The commit record (strings, as Redis holds it) as the trainer's facts for the report."""
    return ev.TrainerFacts(
        step=int(record.get("step", 0)),
        version=int(record.get("version", 0)),
        checkpoint=record.get("checkpoint", ""),
        trained=int(record.get("trained", 0)),
        trained_twice=int(record.get("trained_twice", 0)),
        worker_id=record.get("worker_id", ""),
        fencing_token=int(record.get("fencing_token", 0)),
    )
