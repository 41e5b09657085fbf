"""The planner's own lease and the plan going out: recorded in the run's plan history under that
lease, then published on the durable `plan` stream and read back."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from services.common import subjects
from services.common.bus import Bus
from services.common.contracts import ev
from services.common.logging import get_logger
from services.common.membership import HYBRID_ROLE, LENT_ROLE, PARKED_ROLE
from services.common.metrics import planner_metrics
from services.common.ownership import OwnershipStore
from services.planner.history import PLANNER_ROLE, PlanHistory
from services.planner.plan_state import PlanState
from services.policy.assign import ROLE_BY_KIND


class PlanPublisher:
    def __init__(
        self,
        lease_ttl_s: float,
        bus: Bus,
        store: OwnershipStore,
        history: PlanHistory,
        state: PlanState,
        worker_id: str,
    ):
        self.lease_ttl_s, self.bus, self.store, self.history, self.state = (
            lease_ttl_s,
            bus,
            store,
            history,
            state,
        )
        self.worker_id = worker_id
        self.log = get_logger(component="planner")
        self._one_at_a_time = asyncio.Lock()

    async def hold_lease(self) -> bool:
        """Renews the planner's lease, or takes it when free (a new epoch). Without it the planner
        does nothing: another planner may be in charge."""
        s, ttl = self.state, self.lease_ttl_s
        if s.lease is not None and await self.store.renew(s.lease, ttl):
            return True
        if s.lease is not None:
            self.log.warning("planner_lease_lost", epoch=s.lease.token)
            s.lease = None
        lease = await self.store.acquire(PLANNER_ROLE, self.worker_id, ttl, meta="planner")
        if lease is None:
            return False
        s.lease = lease
        s.dirty = True  # the plan goes out again under the new epoch
        self.log.info("planner_lease_taken", epoch=lease.token)
        return True

    async def publish(self) -> bool:
        """Records and publishes the plan; False (nothing published) without the planner lease.

        One publication at a time: a tick and a role move that both find the plan changed would
        otherwise each publish it (two versions for one change). The plan is taken as it stands
        when its turn comes; a change made while it goes out makes the plan dirty again, for the
        next publication, and a plan that did not go out leaves it dirty."""
        async with self._one_at_a_time:
            s = self.state
            if s.lease is None:
                return False
            if not s.dirty:
                return True  # the publication before this one took the change out with it
            s.dirty = False
            try:
                published = await self._publish()
            except BaseException:
                s.dirty = True
                raise
            if not published:
                s.dirty = True
            return published

    async def _publish(self) -> bool:
        s = self.state
        assert s.lease is not None
        plan = ev.Plan(
            plan_version=s.version + 1,
            reason=s.reason,
            lease_ttl_s=self.lease_ttl_s,
            planner_epoch=s.lease.token,
            predicted_gain=s.gain,
            buckets=s.buckets,
            assignments=[
                ev.Assignment(
                    worker_id=slot.worker_id,
                    role=slot.role,
                    bucket=slot.bucket,
                    fencing_token=slot.fencing_token,
                    weight_sync_addr=slot.weight_sync_addr,
                    tensor_parallel=slot.tensor_parallel,
                )
                for slot in sorted(s.slots.values(), key=lambda slot: slot.worker_id)
            ],
        )
        record = {
            "version": plan.plan_version,
            "epoch": plan.planner_epoch,
            "reason": plan.reason,
            "predicted_gain": round(plan.predicted_gain, 4),
            "buckets": {b.name: b.max_output_tokens or None for b in plan.buckets},
            "layout": {
                b.name: f"{sum(a.role == 'rollout' and a.bucket == b.name for a in plan.assignments)}xTP"
                f"{b.tensor_parallel}"
                for b in plan.buckets
            },
            "workers": len(plan.assignments),
            "at": time.time(),
        }
        if s.decision is not None:
            record["decision"] = s.decision
        if not await self.history.record_plan(s.lease.token, record):
            self.log.warning("plan_not_published_lease_lost", epoch=s.lease.token)
            s.lease = None
            return False
        m = planner_metrics()
        m.plans.inc()
        m.plan_version.set(plan.plan_version)
        roles = Counter(a.role for a in plan.assignments)
        for role in {*ROLE_BY_KIND.values(), HYBRID_ROLE, LENT_ROLE, PARKED_ROLE, "standby"}:
            m.workers.labels(role).set(roles.get(role, 0))
        s.version = plan.plan_version
        await self._publish_plan(plan)
        s.published(plan)
        self.log.info(
            "plan_published", plan_version=s.version, epoch=plan.planner_epoch, workers=len(s.slots)
        )
        return True

    async def _publish_plan(self, plan: ev.Plan, attempts: int = 5) -> None:
        """Publishes the plan to its stream and reads it back: the stream's last plan must be this
        one. An ack proves little on its own (it comes to an inbox; a forged one would say
        stored), so a plan not found is published again (the msg id keeps that from storing it
        twice)."""
        msg_id = f"plan-{plan.planner_epoch}-{plan.plan_version}"
        for attempt in range(1, attempts + 1):
            await self.bus.publish_durable(subjects.PLAN, plan, msg_id=msg_id)
            stored = await self.bus.last_message(subjects.PLAN, "PLAN", ev.Plan)
            if stored == plan:
                return
            self.log.warning(
                "plan_not_stored",
                plan_version=plan.plan_version,
                stored_version=stored.plan_version if stored is not None else None,
                attempt=attempt,
            )
        raise RuntimeError(f"plan {plan.plan_version} is not in the PLAN stream after {attempts} publishes")
