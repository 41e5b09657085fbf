"""Real infrastructure for integration and e2e tests: one nats-server and one Redis-compatible
server per test session, on free loopback ports."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the tests' model cache is the checkout's (.libra/models), not the user's (~/.cache/libra): every
# test and every service a test starts builds its models there once per checkout
os.environ.setdefault("LIBRA_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".libra"))

from services.common import streams  # noqa: E402
from services.common.localstack import Server, start_nats, start_redis  # noqa: E402
from services.common.runconfig import ModelConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_nats(tmp_path_factory.mktemp("nats"))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_redis(tmp_path_factory.mktemp("redis"))
    yield srv
    srv.stop()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    """A fresh run scope per test, so subjects, streams and keys never collide. On the session's
    NATS its streams and consumers are provisioned first, as `libra run` does before a job."""
    rid = "t" + uuid.uuid4().hex[:10]
    if "nats_server" in request.fixturenames:
        asyncio.run(_provision(request.getfixturevalue("nats_server").url, rid))
    return rid


async def _provision(url: str, run_id: str) -> None:
    nc = await nats.connect(url)
    try:
        await streams.provision(nc.jetstream(), run_id)
    finally:
        await nc.close()


@pytest.fixture(scope="session")
def tiny_model() -> ModelConfig:
    """A 2-layer random Llama with SmolLM2's tokenizer, built once and cached under .libra/models."""
    from services.common.models import resolve_model_dir

    cfg = ModelConfig(source="tiny-random", cache_dir=str(ROOT / ".libra" / "models"))
    resolve_model_dir(cfg)
    return cfg


def pytest_collection_finish(session: pytest.Session) -> None:
    """The image tests' dependency resolution (network-bound, half a minute or more) starts now, in
    the background, when the session will run one of them."""
    if any(item.path.name == "test_images.py" for item in session.items):
        from tests.integration.test_images import start_resolving

        start_resolving()
