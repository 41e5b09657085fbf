"""One engine's WeightSync server on the tiny model, with a live trainer lease, for the push tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from services.common.membership import TRAINER_ROLE
from services.common.ownership import OwnershipStore
from services.common.runconfig import ModelConfig
from services.common.tls import TlsFiles
from services.common.weight_signing import HeaderVerifier
from services.generation.backends.hf import HFBackend
from services.generation.engine import ContinuousEngine
from services.learning.snapshot import Snapshot, snapshot
from services.rollout_engine.weight_sync import WeightSyncServicer, start_server


@contextlib.asynccontextmanager
async def weight_sync_rig(
    model: ModelConfig,
    redis_url: str,
    run_id: str,
    *,
    redis_auth: dict[str, str] | None = None,
    token: str | None = None,
    tls: TlsFiles | None = None,
    max_push_bytes: int = 1 << 30,
    verifier: HeaderVerifier | None = None,
) -> AsyncIterator[dict[str, Any]]:
    backend = HFBackend(model, torch_threads=2, seed=0)
    await backend.start()
    engine = ContinuousEngine(backend, max_batch=2)
    engine.start()
    auth = redis_auth or {}
    store = OwnershipStore.from_url(redis_url, run_id, auth.get("password"), username=auth.get("username"))
    servicer = WeightSyncServicer(engine, store, "engine-a", max_push_bytes=max_push_bytes, verifier=verifier)
    server, port = await start_server(servicer, "127.0.0.1", 0, token, tls)
    lease = await store.acquire(TRAINER_ROLE, "trainer-1", 30)
    assert lease is not None
    try:
        yield {"engine": engine, "backend": backend, "addr": f"127.0.0.1:{port}", "token": lease.token}
    finally:
        await server.stop(grace=0)
        await engine.close(timeout=5)
        await store.close()


def nudged_weights(backend: HFBackend, version: int) -> Snapshot:
    return snapshot({k: v.detach() + 0.01 for k, v in backend.model.named_parameters()}, version)
