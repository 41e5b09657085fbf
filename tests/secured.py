"""nats-server and Redis started with a stack's credentials (its users, each allowed what its role
needs), for the tests of who may do what."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import redis.asyncio as aioredis

from services.common.credentials import StackCredentials
from services.common.localstack import Server, start_nats, start_redis
from services.common.redis_scope import RunKeys


@contextmanager
def secured_nats(creds: StackCredentials, tmp: pytest.TempPathFactory) -> Iterator[Server]:
    d = tmp.mktemp("nats")
    srv = start_nats(d / "data", d / "nats-server.log", config=creds.nats_conf)
    try:
        yield srv
    finally:
        srv.stop()


@contextmanager
def secured_redis(creds: StackCredentials, tmp: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_redis(tmp.mktemp("redis"), config=creds.redis_conf)
    try:
        yield srv
    finally:
        srv.stop()


async def grant_run(srv: Server, creds: StackCredentials, run_id: str) -> RunKeys:
    """Grants the stack's service identities their keys of run `run_id`, as `libra run` does before
    a job (services/common/redis_scope.py); the grant's connection is closed."""
    auth = creds.redis_admin_auth()
    assert auth is not None
    keys = RunKeys(aioredis.from_url(srv.url, **auth), run_id)
    try:
        await keys.grant()
    finally:
        await keys.r.aclose()
    return keys
