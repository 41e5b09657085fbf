"""Leased, fenced ownership of roles and workers in Redis.

A lease is a hash {owner, token} with a TTL. Every successful acquire increments a per-resource
counter, so tokens only grow: a receiver that sees a token lower than the current one knows the
sender lost its lease (paused, partitioned) and refuses to act on its behalf. All state changes are
single Lua scripts, so they are atomic on the server.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from services.common.tls import TlsFiles

ACQUIRE = """
local cur = redis.call('HGET', KEYS[1], 'owner')
if cur and cur ~= ARGV[1] then return {0, tonumber(redis.call('HGET', KEYS[1], 'token'))} end
local token = redis.call('INCR', KEYS[2])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'token', token, 'meta', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, token}
"""

RENEW = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] and redis.call('HGET', KEYS[1], 'token') == ARGV[2] then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
"""

RELEASE = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] and redis.call('HGET', KEYS[1], 'token') == ARGV[2] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""


FENCED_PUSH = """
local held = redis.call('HGET', KEYS[1], 'token')
if not held or tonumber(held) ~= tonumber(ARGV[1]) then return 0 end
redis.call('RPUSH', KEYS[2], ARGV[2])
return 1
"""

COMMIT = """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[2])
local fields = {}
for i = 3, 2 + 2 * n do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[2], unpack(fields))
local twice = 0
for i = 3 + 2 * n, #ARGV do twice = twice + 1 - redis.call('SADD', KEYS[3], ARGV[i]) end
if twice > 0 then redis.call('HINCRBY', KEYS[2], 'trained_twice', twice) end
return 1
"""


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


@dataclass(frozen=True)
class Lease:
    resource: str
    owner: str
    token: int


class OwnershipStore:
    def __init__(self, client: aioredis.Redis, run_id: str):
        self.r = client
        self.run_id = run_id
        self._acquire = client.register_script(ACQUIRE)
        self._renew = client.register_script(RENEW)
        self._release = client.register_script(RELEASE)
        self._commit = client.register_script(COMMIT)
        self._fenced_push = client.register_script(FENCED_PUSH)

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

    async def acquire(self, resource: str, owner: str, ttl_s: float, meta: str = "") -> Lease | None:
        """Takes (or re-takes) the lease; None if another owner holds it. Always issues a new token."""
        ok, token = await self._acquire(
            keys=[self._key(resource), self._fence(resource)], args=[owner, int(ttl_s * 1000), meta]
        )
        return Lease(resource, owner, int(token)) if ok else None

    async def renew(self, lease: Lease, ttl_s: float) -> bool:
        return bool(
            await self._renew(
                keys=[self._key(lease.resource)], args=[lease.owner, lease.token, int(ttl_s * 1000)]
            )
        )

    async def release(self, lease: Lease) -> bool:
        return bool(await self._release(keys=[self._key(lease.resource)], args=[lease.owner, lease.token]))

    async def holder(self, resource: str) -> Lease | None:
        data = await self.r.hgetall(self._key(resource))
        if not data:
            return None
        return Lease(resource, str(data["owner"]), int(data["token"]))

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
        args: list[str | int] = [token, len(record)]
        for k, v in record.items():
            args += [k, v]
        args += sorted(trained)
        keys = [self._key(resource), committed_key(self.run_id), trained_key(self.run_id)]
        return bool(await self._commit(keys=keys, args=args))

    async def fenced_record_plan(self, resource: str, token: int, entry: str) -> bool:
        """Appends a published plan's record to the run's plan history, only while `token` holds
        the lease on `resource` (the planner's): a planner that lost its lease records nothing, and
        publishes nothing either."""
        return await self.fenced_append(resource, token, plans_key(self.run_id), entry)

    async def fenced_append(self, resource: str, token: int, key: str, entry: str) -> bool:
        """Appends `entry` to the list `key` only while `token` holds the lease on `resource`."""
        return bool(await self._fenced_push(keys=[self._key(resource), key], args=[token, entry]))

    async def plans(self) -> list[str]:
        return [str(x) for x in await self.r.lrange(plans_key(self.run_id), 0, -1)]

    async def committed(self) -> dict[str, str]:
        """The trainer's commit record of this run (empty before its first committed step)."""
        return {str(k): str(v) for k, v in (await self.r.hgetall(committed_key(self.run_id))).items()}

    async def close(self) -> None:
        await self.r.aclose()
