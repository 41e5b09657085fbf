"""The run's plan and role history: each entry appended in Redis under the planner's lease (a
planner that lost it records nothing, and publishes nothing either), and the recent history
published as the planner's facts for the job's report (services/common/facts.py)."""

from __future__ import annotations

import json
from collections import deque
from typing import Any

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.facts import FactsOut
from services.common.membership import PLANNER_ROLE
from services.common.ownership import OwnershipStore, plans_key, role_changes_key

KEEP_PLANS = 256
KEEP_ROLE_CHANGES = 1024


class PlanHistory:
    def __init__(self, bus: Bus, store: OwnershipStore):
        self.store = store
        self.facts = FactsOut(bus, subjects.FACTS_PLANNER)
        self.plans: deque[str] = deque(maxlen=KEEP_PLANS)
        self.changes: deque[str] = deque(maxlen=KEEP_ROLE_CHANGES)
        self.plans_total = self.changes_total = 0

    async def start(self) -> None:
        """Picks up what an earlier planner of this run recorded, and publishes it."""
        await self.facts.start()
        r, run_id = self.store.r, self.store.run_id
        self.plans_total = int(await r.llen(plans_key(run_id)))
        self.changes_total = int(await r.llen(role_changes_key(run_id)))
        self.plans.extend(str(x) for x in await r.lrange(plans_key(run_id), -KEEP_PLANS, -1))
        self.changes.extend(str(x) for x in await r.lrange(role_changes_key(run_id), -KEEP_ROLE_CHANGES, -1))
        if self.plans_total or self.changes_total:
            self._publish()

    async def record_plan(self, token: int, record: dict[str, Any]) -> bool:
        """False (nothing recorded) when `token` no longer holds the planner lease."""
        entry = json.dumps(record)
        if not await self.store.fenced_record_plan(PLANNER_ROLE, token, entry):
            return False
        self.plans.append(entry)
        self.plans_total += 1
        self._publish()
        return True

    async def record_role_change(self, token: int, entry: dict[str, Any]) -> bool:
        line = json.dumps(entry)
        if not await self.store.fenced_append(PLANNER_ROLE, token, role_changes_key(self.store.run_id), line):
            return False
        self.changes.append(line)
        self.changes_total += 1
        self._publish()
        return True

    def _publish(self) -> None:
        self.facts.update(
            ev.PlannerFacts(
                plans=list(self.plans),
                plans_total=self.plans_total,
                role_changes=list(self.changes),
                role_changes_total=self.changes_total,
            )
        )
