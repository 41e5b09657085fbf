"""nats-server and Redis started with a stack's credentials (its users, each allowed what its role
needs), for the tests of who may do what."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from services.common.credentials import StackCredentials
from services.common.localstack import Server, start_nats, start_redis


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
