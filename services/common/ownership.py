"""Leased, fenced ownership of roles and workers in Redis.

A lease is a hash {owner, token} with a TTL. Every successful acquire increments a per-resource
counter, so tokens only grow: a receiver that sees a token lower than the current one knows the
sender lost its lease (paused, partitioned) and refuses to act on its behalf. Every state change is
a check-and-set: the keys it depends on are WATCHed, read, and written in one MULTI/EXEC that
Redis applies only if none of them changed meanwhile (else it is tried again). No Lua: service
identities may not script Redis (services/common/credentials.py), so none can run a script that
holds the server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import WatchError

from services.common.tls import TlsFiles

T = TypeVar("T")
WATCH_RETRIES = 64
"""Attempts of one check-and-set before giving up (another client changed a watched key each time)."""


class Contended(RuntimeError):
    """A check-and-set lost the race to other clients WATCH_RETRIES times in a row."""


def committed_key(run_id: str) -> str:
    """The trainer's commit record: step, version and checkpoint of its last committed step."""
    return f"libra:{run_id}:trainer:committed"


def plans_key(run_id: str) -> str:
    """Every plan the planner published, oldest first (JSON: version, epoch, reason, gain, ...)."""
    return f"libra:{run_id}:plans"


def role_changes_key(run_id: str) -> str:
    """The run's role changes and each worker's steps through them, oldest first (JSON lines of
    either {worker, from, to, at} or {worker, state, seconds, generation, at})."""
    return f"libra:{run_id}:role_changes"


def trained_key(run_id: str) -> str:
    """Every trajectory id a committed step trained on."""
    return f"libra:{run_id}:trained"


LEDGER_KEYS = ("feed", "outstanding", "published", "outcomes", "decided", "policy", "eval", "heard_trained")
"""The scheduler's ledger (services/scheduler/ledger.py): `libra:<run>:scheduler:<name>` each."""


def ledger_key(run_id: str, name: str) -> str:
    assert name in LEDGER_KEYS, name
    return f"libra:{run_id}:scheduler:{name}"


@dataclass(frozen=True)
class Lease:
    resource: str
    owner: str
    token: int


class OwnershipStore:
    def __init__(self, client: aioredis.Redis, run_id: str):
        self.r = client
        self.run_id = run_id

    @classmethod
    def from_url(
        cls,
        url: str,
        run_id: str,
        password: str | None = None,
        tls: TlsFiles | None = None,
        *,
        username: str | None = None,
    ) -> OwnershipStore:
        options = tls.redis_options(url) if tls is not None else {}
        client = aioredis.from_url(
            url, decode_responses=True, username=username, password=password, **options
        )
        return cls(client, run_id)

    def _key(self, resource: str) -> str:
        return f"libra:{self.run_id}:lease:{resource}"

    def _fence(self, resource: str) -> str:
        return f"libra:{self.run_id}:fence:{resource}"

    async def _check_and_set(self, keys: list[str], body: Callable[[Any], Awaitable[T]]) -> T:
        """Runs `body(pipe)` with `keys` watched: it reads in immediate mode, then queues its
        writes after `pipe.multi()` and executes them; a watched key changed in between aborts
        the writes, and the whole is tried again."""
        for _ in range(WATCH_RETRIES):
            async with self.r.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(*keys)
                    return await body(pipe)
                except WatchError:
                    continue
        raise Contended(f"{keys}: changed by other clients {WATCH_RETRIES} times in a row")

    async def acquire(self, resource: str, owner: str, ttl_s: float, meta: str = "") -> Lease | None:
        """Takes (or re-takes) the lease; None if another owner holds it. Always issues a new token."""
        key, fence = self._key(resource), self._fence(resource)

        async def take(pipe: Any) -> Lease | None:
            cur = await pipe.hget(key, "owner")
            if cur is not None and cur != owner:
                return None
            token = int(await pipe.get(fence) or 0) + 1
            pipe.multi()
            pipe.set(fence, token)
            pipe.hset(key, mapping={"owner": owner, "token": token, "meta": meta})
            pipe.pexpire(key, int(ttl_s * 1000))
            await pipe.execute()
            return Lease(resource, owner, token)

        return await self._check_and_set([key, fence], take)

    async def _if_held(self, lease: Lease, then: Callable[[Any], None]) -> bool:
        """Queues `then(pipe)` and applies it only while `lease` (owner and token) is the live one."""
        key = self._key(lease.resource)

        async def check(pipe: Any) -> bool:
            held = await pipe.hmget(key, ["owner", "token"])
            if held != [lease.owner, str(lease.token)]:
                return False
            pipe.multi()
            then(pipe)
            await pipe.execute()
            return True

        return await self._check_and_set([key], check)

    async def renew(self, lease: Lease, ttl_s: float) -> bool:
        key = self._key(lease.resource)
        return await self._if_held(lease, lambda pipe: pipe.pexpire(key, int(ttl_s * 1000)))

    async def release(self, lease: Lease) -> bool:
        key = self._key(lease.resource)
        return await self._if_held(lease, lambda pipe: pipe.delete(key))

    async def holder(self, resource: str) -> Lease | None:
        data = await self.r.hgetall(self._key(resource))
        if not data:
            return None
        return Lease(resource, str(data["owner"]), int(data["token"]))

    async def holders(self, resources: list[str]) -> list[Lease | None]:
        """`holder` of each resource, read in one round trip (a pipeline without a transaction):
        the planner looks at every worker's lease each tick, 1,028 of them at 1,024 engines."""
        pipe = self.r.pipeline(transaction=False)
        for resource in resources:
            pipe.hgetall(self._key(resource))
        found = await pipe.execute() if resources else []
        return [
            Lease(resource, str(data["owner"]), int(data["token"])) if data else None
            for resource, data in zip(resources, found, strict=True)
        ]

    async def is_current(self, resource: str, token: int) -> bool:
        """True when `token` is the live lease's token: the check every receiver makes."""
        held = await self.holder(resource)
        return held is not None and held.token == token

    async def fenced_commit(
        self, resource: str, token: int, record: dict[str, str | int], trained: set[str]
    ) -> bool:
        """Writes the commit record and adds `trained` to the trained set, atomically, only while
        `token` still holds the lease on `resource`: a trainer that lost its lease commits nothing.
        Ids already in the set add to the record's `trained_twice` (the report's count of them)."""
        lease_key, record_key, set_key = (
            self._key(resource),
            committed_key(self.run_id),
            trained_key(self.run_id),
        )
        ids = sorted(trained)

        async def commit(pipe: Any) -> bool:
            if await pipe.hget(lease_key, "token") != str(token):
                return False
            twice = sum(map(bool, await pipe.smismember(set_key, ids))) if ids else 0
            pipe.multi()
            pipe.hset(record_key, mapping=record)
            if ids:
                pipe.sadd(set_key, *ids)
            if twice:
                pipe.hincrby(record_key, "trained_twice", twice)
            await pipe.execute()
            return True

        return await self._check_and_set([lease_key, set_key], commit)

    async def fenced_record_plan(self, resource: str, token: int, entry: str) -> bool:
        """Appends a published plan's record to the run's plan history, only while `token` holds
        the lease on `resource` (the planner's): a planner that lost its lease records nothing, and
        publishes nothing either."""
        return await self.fenced_append(resource, token, plans_key(self.run_id), entry)

    async def fenced_append(self, resource: str, token: int, key: str, entry: str) -> bool:
        """Appends `entry` to the list `key` only while `token` holds the lease on `resource`."""
        lease_key = self._key(resource)

        async def append(pipe: Any) -> bool:
            if await pipe.hget(lease_key, "token") != str(token):
                return False
            pipe.multi()
            pipe.rpush(key, entry)
            await pipe.execute()
            return True

        return await self._check_and_set([lease_key], append)

    async def plans(self) -> list[str]:
        return [str(x) for x in await self.r.lrange(plans_key(self.run_id), 0, -1)]

    async def committed(self) -> dict[str, str]:
        """The trainer's commit record of this run (empty before its first committed step)."""
        return {str(k): str(v) for k, v in (await self.r.hgetall(committed_key(self.run_id))).items()}

    async def close(self) -> None:
        await self.r.aclose()
