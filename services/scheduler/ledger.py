"""The scheduler's durable ledger, in Redis (append-only file on): the feed's cursor, the groups
launched and not yet decided by the trainer, and the trajectories already handed to the trainer.

A restarted scheduler reads it back and re-issues exactly the trajectories of undecided groups
that had not reached the trainer, under their own ids, so nothing is generated twice into the
trainer (a trajectory published just before the crash and again after it is deduplicated by
JetStream's message id, and by the trainer's trained ids) and nothing is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.scheduler.feed import GroupTicket, TaskFeed


@dataclass
class LedgerState:
    launched: int
    replaced: int
    total_groups: int
    completed: int
    failed: int
    outstanding: dict[str, int]
    published: set[str]
    outcomes: dict[str, int] = field(default_factory=dict)


class Ledger:
    def __init__(self, redis: Any, run_id: str):
        self.r = redis
        prefix = f"libra:{run_id}:scheduler"
        self.feed_key = f"{prefix}:feed"
        self.outstanding_key = f"{prefix}:outstanding"
        self.published_key = f"{prefix}:published"
        self.outcomes_key = f"{prefix}:outcomes"

    async def load(self) -> LedgerState | None:
        """What an earlier scheduler of this run recorded, or None for a fresh run."""
        feed = await self.r.hgetall(self.feed_key)
        if not feed:
            return None
        return LedgerState(
            launched=int(feed.get("launched", 0)),
            replaced=int(feed.get("replaced", 0)),
            total_groups=int(feed.get("total_groups", 0)),
            completed=int(feed.get("completed", 0)),
            failed=int(feed.get("failed", 0)),
            outstanding={k: int(v) for k, v in (await self.r.hgetall(self.outstanding_key)).items()},
            published=set(await self.r.smembers(self.published_key)),
            outcomes={k: int(v) for k, v in (await self.r.hgetall(self.outcomes_key)).items()},
        )

    def _cursor(self, feed: TaskFeed) -> dict[str, int]:
        return {"launched": feed.launched, "replaced": feed.replaced, "total_groups": feed.total_groups}

    async def launched(self, feed: TaskFeed, tickets: list[GroupTicket]) -> None:
        """Written before the groups' trajectories start."""
        async with self.r.pipeline(transaction=True) as p:
            p.hset(self.feed_key, mapping=self._cursor(feed))
            p.hset(self.outstanding_key, mapping={t.group_id: t.index for t in tickets})
            await p.execute()

    async def resolved(self, feed: TaskFeed, group_id: str, outcome: str) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.hset(self.feed_key, mapping=self._cursor(feed))
            p.hdel(self.outstanding_key, group_id)
            p.hincrby(self.outcomes_key, outcome, 1)
            await p.execute()

    async def published(self, trajectory_id: str, failed: bool) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.sadd(self.published_key, trajectory_id)
            p.hincrby(self.feed_key, "completed", 1)
            if failed:
                p.hincrby(self.feed_key, "failed", 1)
            await p.execute()
