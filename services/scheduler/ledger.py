"""The scheduler's durable ledger, in Redis (append-only file on): the feed's cursor, the groups
launched and not yet decided by the trainer, and the trajectories already handed to the trainer.

A restarted scheduler reads it back and re-issues exactly the trajectories of undecided groups
that had not reached the trainer, under their own ids, so nothing is generated twice into the
trainer (a trajectory published just before the crash and again after it is deduplicated by
JetStream's message id, and by the trainer's trained ids) and nothing is lost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from services.common.contracts import ev
from services.common.credentials import REDIS_MAX_VALUE_BYTES
from services.common.errors import FencedOut
from services.common.ownership import ledger_key
from services.scheduler.feed import GroupTicket, TaskFeed, group_of


async def durably(write: Awaitable[Any], log: Any) -> None:
    """A ledger write; if Redis is away the run goes on, only a restart could not resume it. One
    refused because this scheduler no longer surely holds the role (`FencedOut`) is raised."""
    try:
        await write
    except FencedOut:
        raise
    except Exception as err:
        log.warning("ledger_write_failed", error=f"{type(err).__name__}: {err}")


async def _always() -> None:
    """Every write goes ahead (a ledger read back, or one in a test)."""


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
    def __init__(self, redis: Any, run_id: str, guard: Callable[[], Awaitable[None]] | None = None):
        """`guard` is awaited before every write, and raises to refuse it: the scheduler's role
        lease (`services/scheduler/leadership.py`), so that one paused past it writes nothing."""
        self.r = redis
        self.guard = guard or _always
        self.feed_key = ledger_key(run_id, "feed")
        self.outstanding_key = ledger_key(run_id, "outstanding")
        self.published_key = ledger_key(run_id, "published")
        self.outcomes_key = ledger_key(run_id, "outcomes")
        self.decided_key = ledger_key(run_id, "decided")
        self.policy_key = ledger_key(run_id, "policy")
        self.eval_key = ledger_key(run_id, "eval")
        self.trained_key = ledger_key(run_id, "heard_trained")
        """The trajectories the trainer's `trained` outcomes named (the trainer's own set is its own)."""
        self.changed = True
        """Written since the last `facts` (the report's view is re-read only then)."""

    async def save_policy(self, raw: str) -> None:
        """What the routing policy learned (C-MLFQ's prefix trees), for a restarted scheduler, as
        JSON (`routing_memory.encode`). Refused here when over Redis's bound on a value: Redis
        would answer a protocol error and drop the connection the role's lease renews on."""
        if len(raw) > REDIS_MAX_VALUE_BYTES:
            raise ValueError(f"routing state of {len(raw)} bytes is over Redis's {REDIS_MAX_VALUE_BYTES}")
        await self.guard()
        await self.r.set(self.policy_key, raw)

    async def load_policy(self) -> str | None:
        """The saved routing policy state as stored (JSON): large at a thousand engines, so the
        caller decodes it off its event loop."""
        raw = await self.r.get(self.policy_key)
        return None if raw is None else str(raw)

    async def eval_done(self, version: int, summary: dict[str, Any]) -> None:
        """A finished evaluation round (services/scheduler/evaluation.py), by policy version."""
        await self.guard()
        self.changed = True
        await self.r.hset(self.eval_key, str(version), json.dumps(summary))

    async def load_eval(self) -> dict[int, dict[str, Any]]:
        return {int(k): json.loads(v) for k, v in (await self.r.hgetall(self.eval_key)).items()}

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
        await self.guard()
        self.changed = True
        async with self.r.pipeline(transaction=True) as p:
            p.hset(self.feed_key, mapping=self._cursor(feed))
            p.hset(self.outstanding_key, mapping={t.group_id: t.index for t in tickets})
            await p.execute()

    async def resolved(self, feed: TaskFeed, group_id: str, outcome: str, trained: list[str]) -> None:
        await self.guard()
        self.changed = True
        async with self.r.pipeline(transaction=True) as p:
            p.hset(self.feed_key, mapping=self._cursor(feed))
            p.hdel(self.outstanding_key, group_id)
            p.hincrby(self.outcomes_key, outcome, 1)
            p.hset(self.decided_key, group_id, outcome)
            if trained:
                p.sadd(self.trained_key, *trained)
            await p.execute()

    async def heard_trained(self, trained: list[str]) -> None:
        """Trained members of a group already decided (the trainer re-announces those delivered again)."""
        await self.guard()
        self.changed = True
        await self.r.sadd(self.trained_key, *trained)

    async def published(self, trajectory_id: str, failed: bool) -> None:
        await self.guard()
        self.changed = True
        async with self.r.pipeline(transaction=True) as p:
            p.sadd(self.published_key, trajectory_id)
            p.hincrby(self.feed_key, "completed", 1)
            if failed:
                p.hincrby(self.feed_key, "failed", 1)
            await p.execute()


@dataclass
class Accounting:
    """Where every trajectory the trainer was handed ended up (the report's lost and open counts)."""

    published: int
    trained: int
    dropped: int
    """In groups the trainer decided `stale`, `failed` or `filtered` (the feed replaced them)."""
    open_at_end: int
    """In groups not decided when the job ended (launched beyond the last step, or in flight)."""
    lost: list[str]
    """Handed to the trainer, in a group decided `trained`, yet not named by the trainer's
    `trained` outcomes; or in a group the ledger has no record of. Should always be empty."""


def account(
    published: set[str], trained: set[str], decided: dict[str, str], outstanding: set[str]
) -> Accounting:
    """Pure: from the ledger's published ids, the ids the trainer's `trained` outcomes named, and
    the decided and outstanding groups."""
    n_trained = dropped = open_at_end = 0
    lost = []
    for tid in sorted(published):
        group = group_of(tid)
        if tid in trained:
            n_trained += 1
        elif decided.get(group) in ("stale", "failed", "filtered"):
            dropped += 1
        elif group in outstanding:
            open_at_end += 1
        else:
            lost.append(tid)
    return Accounting(len(published), n_trained, dropped, open_at_end, lost)


async def ledger_facts(ledger: Ledger) -> ev.SchedulerFacts:
    """The ledger as the job's report reads it: the accounting, from the ledger alone, and the
    finished evaluation rounds (an unreadable ledger gives the error instead of counts)."""
    ledger.changed = False
    now = time.time()
    try:
        acc = account(
            set(await ledger.r.smembers(ledger.published_key)),
            set(await ledger.r.smembers(ledger.trained_key)),
            dict(await ledger.r.hgetall(ledger.decided_key)),
            set(await ledger.r.hkeys(ledger.outstanding_key)),
        )
        rounds = await ledger.r.hgetall(ledger.eval_key)
    except Exception as err:  # Redis away: said so, and read again at the next change
        ledger.changed = True
        return ev.SchedulerFacts(error=f"{type(err).__name__}: {err}", as_of_unix=now)
    return ev.SchedulerFacts(
        published=acc.published,
        trained=acc.trained,
        dropped=acc.dropped,
        open_at_end=acc.open_at_end,
        lost=len(acc.lost),
        lost_ids=acc.lost[:20],
        eval_rounds={int(k): str(v) for k, v in rounds.items()},
        as_of_unix=now,
    )
