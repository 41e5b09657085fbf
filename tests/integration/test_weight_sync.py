"""WeightSync over a real grpc.aio server, real Redis fencing and the tiny model."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
import torch

from services.common.contracts import ws, ws_grpc
from services.common.localstack import Server
from services.common.membership import TRAINER_ROLE
from services.common.ownership import OwnershipStore
from services.common.runconfig import ModelConfig
from services.common.weights import checksum, chunks, pack_state_dict
from services.rollout_engine.backends.base import GenRequest
from services.rollout_engine.backends.hf import HFBackend
from services.rollout_engine.engine import ContinuousEngine
from services.rollout_engine.weight_sync import WeightSyncServicer, start_server

pytestmark = pytest.mark.integration

CHUNK = 256 << 10
PROMPT = GenRequest(list(range(200, 216)), 8, 0.0)


@pytest.fixture(scope="module")
def backend(tiny_model: ModelConfig) -> HFBackend:
    b = HFBackend(tiny_model, torch_threads=2, seed=0)
    asyncio.run(b.start())
    return b


@pytest.fixture
def store(redis_server: Server, run_id: str) -> Iterator[OwnershipStore]:
    yield OwnershipStore.from_url(redis_server.url, run_id)


@pytest.fixture
async def rig(backend: HFBackend, store: OwnershipStore) -> AsyncIterator[dict[str, Any]]:
    engine = ContinuousEngine(backend, max_batch=4)
    engine.start()
    server, port = await start_server(WeightSyncServicer(engine, store, "engine-a"), "127.0.0.1", 0)
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts)
    lease = await store.acquire(TRAINER_ROLE, "trainer-1", 30)
    assert lease is not None
    yield {"engine": engine, "stub": ws_grpc.WeightSyncStub(channel), "token": lease.token, "store": store}
    await channel.close()
    await server.stop(grace=0)
    await engine.close(timeout=5)
    await store.close()


def perturbed(backend: HFBackend, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v + 0.5 * torch.randn(v.shape, generator=g)).clone()
        for k, v in backend.model.state_dict().items()
    }


def stream(blob: bytes, *, version: int, token: int, **header: Any) -> list[ws.WeightChunk]:
    parts = list(chunks(blob, CHUNK))
    h = ws.WeightHeader(
        version=version,
        total_bytes=len(blob),
        num_chunks=len(parts),
        checksum=checksum(blob),
        fencing_token=token,
        sender_id="trainer-1",
        format="safetensors",
    )
    for k, v in header.items():
        setattr(h, k, v)
    msgs = [ws.WeightChunk(index=i, data=p) for i, p in enumerate(parts)]
    msgs[0].header.CopyFrom(h)
    return msgs


async def push(stub: Any, msgs: list[ws.WeightChunk]) -> ws.PushAck:
    async def gen() -> AsyncIterator[ws.WeightChunk]:
        for m in msgs:
            yield m

    return await stub.PushWeights(gen(), timeout=30)


async def greedy(engine: ContinuousEngine) -> list[int]:
    return (await engine.submit(PROMPT)).output.token_ids


async def test_push_new_version_is_applied_and_changes_generation(
    rig: dict[str, Any], backend: HFBackend
) -> None:
    engine, stub = rig["engine"], rig["stub"]
    before = await greedy(engine)
    blob = pack_state_dict(perturbed(backend, 1))
    msgs = stream(blob, version=1, token=rig["token"])
    assert len(msgs) > 1, "the test pushes more than one chunk"
    ack = await push(stub, msgs)
    assert (ack.accepted, ack.code, ack.version) == (True, "ok", 1)
    assert ack.apply_s > 0
    info = await stub.GetVersion(ws.VersionRequest())
    assert (info.engine_id, info.version, info.checksum) == ("engine-a", 1, checksum(blob))
    done = await engine.submit(PROMPT)
    assert done.policy_version == 1
    assert done.output.token_ids != before

    again = await push(stub, stream(blob, version=1, token=rig["token"]))
    assert (again.accepted, again.code) == (False, "stale_version")


async def test_stale_fencing_token_is_rejected_and_changes_nothing(
    rig: dict[str, Any], backend: HFBackend
) -> None:
    engine, stub, store = rig["engine"], rig["stub"], rig["store"]
    old = engine.version
    weights_before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    blob = pack_state_dict(perturbed(backend, 2))

    # A new trainer took the role: the old token is fenced off.
    held = await store.holder(TRAINER_ROLE)
    assert held is not None and await store.release(held)
    new = await store.acquire(TRAINER_ROLE, "trainer-2", 30)
    assert new is not None and new.token > rig["token"]
    ack = await push(stub, stream(blob, version=old + 1, token=rig["token"]))
    assert (ack.accepted, ack.code) == (False, "stale_token")

    ack = await push(stub, stream(blob, version=old + 1, token=new.token + 5))
    assert (ack.accepted, ack.code) == (False, "stale_token")

    assert (await stub.GetVersion(ws.VersionRequest())).version == old
    for k, v in backend.model.state_dict().items():
        assert torch.equal(v, weights_before[k])

    ack = await push(stub, stream(blob, version=old + 1, token=new.token))
    assert ack.accepted and ack.version == old + 1


@pytest.mark.parametrize(
    ("damage", "code"),
    [
        ("flip_byte", "checksum_mismatch"),
        ("drop_chunk", "checksum_mismatch"),
        ("wrong_count", "checksum_mismatch"),
        ("no_header", "malformed"),
        ("bad_format", "malformed"),
        ("not_safetensors", "malformed"),
        ("unknown_tensor", "malformed"),
    ],
)
async def test_damaged_push_is_rejected_and_version_unchanged(
    rig: dict[str, Any], backend: HFBackend, damage: str, code: str
) -> None:
    engine, stub, token = rig["engine"], rig["stub"], rig["token"]
    old = engine.version
    sd = perturbed(backend, 3)
    if damage == "unknown_tensor":
        sd["not.a.weight"] = torch.zeros(3)
    blob = b"\x00" * 1000 if damage == "not_safetensors" else pack_state_dict(sd)
    msgs = stream(blob, version=old + 1, token=token)
    if damage == "flip_byte":
        data = bytearray(msgs[-1].data)
        data[len(data) // 2] ^= 0xFF
        msgs[-1].data = bytes(data)
    elif damage == "drop_chunk":
        del msgs[1]
    elif damage == "wrong_count":
        msgs[0].header.num_chunks += 3
    elif damage == "no_header":
        msgs[0].ClearField("header")
    elif damage == "bad_format":
        msgs[0].header.format = "pickle"
    ack = await push(stub, msgs)
    assert (ack.accepted, ack.code) == (False, code), ack.message
    info = await stub.GetVersion(ws.VersionRequest())
    assert info.version == old and engine.version == old
