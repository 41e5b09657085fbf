"""The plan as the planner holds it between publications: every worker's slot, the buckets, the
planner's own lease, and why the next plan goes out. One object, shared by the planner's parts
(registration, role moves, re-fits, publishing); each part changes only what its job is about."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.contracts import ev
from services.common.ownership import Lease
from services.common.runconfig import BucketConfig
from services.policy.assign import Slot


@dataclass
class PlanState:
    buckets: list[ev.BucketSpec]
    slots: dict[str, Slot] = field(default_factory=dict)
    version: int = 0
    """The last plan version published."""
    dirty: bool = False
    """Something changed since: the next tick publishes."""
    lease: Lease | None = None
    """The planner's own lease; its token is the plan's `planner_epoch`."""
    reason: str = "static"
    gain: float = 0.0
    """Predicted fractional reduction of the rollout time that justified the next plan."""
    decision: dict[str, object] | None = None
    """What the re-fit in the next plan simulated (`WhatIf.record`), for its plan record."""

    @classmethod
    def of_buckets(cls, buckets: list[BucketConfig]) -> PlanState:
        """The state before any plan: the job's buckets (rollout.buckets), no engine yet."""
        return cls(
            [
                ev.BucketSpec(
                    name=b.name,
                    tensor_parallel=b.tensor_parallel,
                    max_context_tokens=b.max_context_tokens,
                    max_output_tokens=b.max_output_tokens or 0,
                )
                for b in buckets
            ]
        )

    def continue_from(self, last: ev.Plan) -> None:
        """A restarted planner continues the last plan, and its version numbers."""
        self.version = last.plan_version
        for a in last.assignments:
            self.slots[a.worker_id] = Slot(
                a.worker_id, "", a.role, a.bucket, a.weight_sync_addr, a.tensor_parallel, a.fencing_token
            )
        if [b.name for b in last.buckets] == [b.name for b in self.buckets]:
            self.buckets = [ev.BucketSpec.FromString(b.SerializeToString()) for b in last.buckets]

    def changed(self, reason: str, gain: float = 0.0, decision: dict[str, object] | None = None) -> None:
        self.reason, self.gain, self.decision = reason, gain, decision
        self.dirty = True

    def published(self, plan: ev.Plan) -> None:
        """`plan` went out. `dirty` is the publisher's, and a change made while it went out keeps
        its reason: both stay for the next plan."""
        self.version = plan.plan_version
        if self.reason == plan.reason:
            self.reason, self.gain, self.decision = "membership", 0.0, None
