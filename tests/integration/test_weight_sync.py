"""WeightSync over real grpc.aio servers, real Redis fencing and the tiny model: full pushes, sparse
deltas applied bit-identically, bf16 on the wire, damage refused (before any write: nothing
changes; after: the engine is torn, generates nothing, and a full push repairs it), relay trees."""

from __future__ import annotations

import asyncio
import contextlib
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
from services.common.weight_signing import HeaderSigner, HeaderVerifier, new_signing_key, public_key
from services.generation.backends.base import GenRequest
from services.generation.backends.hf import HFBackend
from services.generation.engine import ContinuousEngine
from services.learning.snapshot import Snapshot, snapshot
from services.rollout_engine.weight_sync import WeightSyncServicer, start_server
from services.trainer.weight_push import WeightPusher, encode_delta, encode_dense

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
    servicer = WeightSyncServicer(engine, store, "engine-a", record_timeout_s=2.0)
    server, port = await start_server(servicer, "127.0.0.1", 0)
    opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts)
    lease = await store.acquire(TRAINER_ROLE, "trainer-1", 30)
    assert lease is not None
    yield {
        "engine": engine,
        "stub": ws_grpc.WeightSyncStub(channel),
        "token": lease.token,
        "store": store,
        "addr": f"127.0.0.1:{port}",
    }
    await channel.close()
    await server.stop(grace=0)
    await engine.close(timeout=5)
    await store.close()


def perturbed(backend: HFBackend, seed: int) -> dict[str, torch.Tensor]:
    """New values for every parameter (tied ones once, as the trainer sends them)."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: (v.detach() + 0.5 * torch.randn(v.shape, generator=g)).clone()
        for k, v in backend.model.named_parameters()
    }


def frames(snap: Snapshot, *, token: int, base: Snapshot | None = None) -> list[ws.WeightChunk]:
    enc = encode_dense(snap, CHUNK) if base is None else encode_delta(base, snap, CHUNK)
    return [ws.WeightChunk(header=enc.header(token, "trainer-1")), *enc.records]


async def push(stub: Any, msgs: list[ws.WeightChunk]) -> ws.PushAck:
    async def gen() -> AsyncIterator[ws.WeightChunk]:
        for m in msgs:
            yield m

    return await stub.PushWeights(gen(), timeout=30)


async def push_and_stall(addr: str, msgs: list[ws.WeightChunk], sent: int) -> ws.PushAck:
    """The sender stops sending after `sent` messages, its stream left open (a frozen trainer)."""
    async with grpc.aio.insecure_channel(addr) as channel:

        async def gen() -> AsyncIterator[ws.WeightChunk]:
            for m in msgs[:sent]:
                yield m
            await asyncio.Event().wait()

        return await ws_grpc.WeightSyncStub(channel).PushWeights(gen(), timeout=30)


async def push_and_vanish(addr: str, msgs: list[ws.WeightChunk], sent: int) -> None:
    """The sender goes away (its connection closes) after `sent` messages."""
    channel = grpc.aio.insecure_channel(addr)
    done = asyncio.Event()

    async def gen() -> AsyncIterator[ws.WeightChunk]:
        for m in msgs[:sent]:
            yield m
        done.set()
        await asyncio.Event().wait()

    call = asyncio.ensure_future(ws_grpc.WeightSyncStub(channel).PushWeights(gen(), timeout=30))
    await done.wait()
    await asyncio.sleep(0.2)
    await channel.close()
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
        await call


async def greedy(engine: ContinuousEngine) -> list[int]:
    return (await engine.submit(PROMPT)).output.token_ids


def held(backend: HFBackend) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in backend.model.state_dict().items()}


async def test_push_new_version_is_applied_and_changes_generation(
    rig: dict[str, Any], backend: HFBackend
) -> None:
    engine, stub = rig["engine"], rig["stub"]
    before = await greedy(engine)
    snap = snapshot(perturbed(backend, 1), 1)
    msgs = frames(snap, token=rig["token"])
    assert len(msgs) > 2, "the test pushes more than one record"
    ack = await push(stub, msgs)
    assert (ack.accepted, ack.code, ack.version) == (True, "ok", 1), ack.message
    assert ack.apply_s > 0
    info = await stub.GetVersion(ws.VersionRequest())
    assert (info.engine_id, info.version, info.checksum, info.torn) == ("engine-a", 1, snap.checksum, False)
    assert info.accepts_deltas
    for name, t in zip(snap.names, snap.tensors, strict=True):
        assert torch.equal(backend.model.state_dict()[name].reshape(-1), t)
    done = await engine.submit(PROMPT)
    assert done.policy_version == 1
    assert done.output.token_ids != before

    again = await push(stub, frames(snap, token=rig["token"]))
    assert (again.accepted, again.code) == (False, "stale_version")


async def test_a_sparse_delta_is_small_and_lands_bit_identical(
    rig: dict[str, Any], backend: HFBackend
) -> None:
    stub, token = rig["stub"], rig["token"]
    v1 = snapshot(perturbed(backend, 4), 1)
    assert (await push(stub, frames(v1, token=token))).accepted
    state = {n: t.view(s).clone() for n, s, t in zip(v1.names, v1.shapes, v1.tensors, strict=True)}
    g = torch.Generator().manual_seed(5)
    for t in state.values():  # about 1 % of the elements move
        flat = t.view(-1)
        hit = torch.rand(flat.numel(), generator=g) < 0.01
        flat[hit] += 0.125
    v2 = snapshot(state, 2)
    delta = encode_delta(v1, v2, CHUNK)
    dense = encode_dense(v2, CHUNK)
    assert delta.sparse_tensors > 0 and delta.total_bytes * 20 < dense.total_bytes
    ack = await push(stub, frames(v2, token=token, base=v1))
    assert (ack.accepted, ack.version) == (True, 2), ack.message
    assert (await stub.GetVersion(ws.VersionRequest())).checksum == v2.checksum
    for name, t in zip(v2.names, v2.tensors, strict=True):
        assert torch.equal(backend.model.state_dict()[name].reshape(-1), t), name
    # a delta from a version the engine does not hold changes nothing
    before = held(backend)
    v3 = snapshot({k: v + 1.0 for k, v in state.items()}, 3)
    ack = await push(stub, frames(v3, token=token, base=v1))
    assert (ack.accepted, ack.code) == (False, "base_mismatch")
    assert all(torch.equal(v, before[k]) for k, v in backend.model.state_dict().items())
    assert not rig["engine"].torn


async def test_bf16_on_the_wire_lands_as_bf16_values(rig: dict[str, Any], backend: HFBackend) -> None:
    snap = snapshot(perturbed(backend, 6), 1, "bfloat16")
    dense32 = encode_dense(snapshot(perturbed(backend, 6), 1), CHUNK)
    assert encode_dense(snap, CHUNK).total_bytes * 2 == dense32.total_bytes
    ack = await push(rig["stub"], frames(snap, token=rig["token"]))
    assert ack.accepted, ack.message
    for name, t in zip(snap.names, snap.tensors, strict=True):
        here = backend.model.state_dict()[name]
        assert here.dtype == torch.float32 and torch.equal(here.reshape(-1).to(torch.bfloat16), t)


async def test_stale_fencing_token_is_rejected_and_changes_nothing(
    rig: dict[str, Any], backend: HFBackend
) -> None:
    engine, stub, store = rig["engine"], rig["stub"], rig["store"]
    old = engine.version
    weights_before = held(backend)
    sd = perturbed(backend, 2)

    # A new trainer took the role: the old token is fenced off.
    holder = await store.holder(TRAINER_ROLE)
    assert holder is not None and await store.release(holder)
    new = await store.acquire(TRAINER_ROLE, "trainer-2", 30)
    assert new is not None and new.token > rig["token"]
    ack = await push(stub, frames(snapshot(sd, old + 1), token=rig["token"]))
    assert (ack.accepted, ack.code) == (False, "stale_token")

    ack = await push(stub, frames(snapshot(sd, old + 1), token=new.token + 5))
    assert (ack.accepted, ack.code) == (False, "stale_token")

    assert (await stub.GetVersion(ws.VersionRequest())).version == old
    for k, v in backend.model.state_dict().items():
        assert torch.equal(v, weights_before[k])

    ack = await push(stub, frames(snapshot(sd, old + 1), token=new.token))
    assert ack.accepted and ack.version == old + 1


@pytest.mark.parametrize(
    ("damage", "code"),
    [
        ("flip_first_record", "checksum_mismatch"),
        ("no_header", "malformed"),
        ("bad_format", "malformed"),
        ("unknown_tensor", "malformed"),
        ("wrong_shape", "malformed"),
        ("data_with_header", "malformed"),
        ("record_past_the_end", "malformed"),
    ],
)
async def test_a_push_refused_before_any_write_changes_nothing(
    rig: dict[str, Any], backend: HFBackend, damage: str, code: str
) -> None:
    engine, stub, token = rig["engine"], rig["stub"], rig["token"]
    old = engine.version
    before = held(backend)
    sd = perturbed(backend, 3)
    if damage == "unknown_tensor":
        sd["not.a.weight"] = torch.zeros(3)
    if damage == "wrong_shape":
        name = next(iter(sd))
        sd[name] = torch.zeros(3, 3)
    msgs = frames(snapshot(sd, old + 1), token=token)
    if damage == "flip_first_record":
        data = bytearray(msgs[1].data)
        data[len(data) // 2] ^= 0xFF
        msgs[1].data = bytes(data)
    elif damage == "no_header":
        msgs[0].ClearField("header")
        msgs[0].data = b"x"
    elif damage == "bad_format":
        msgs[0].header.format = "pickle"
    elif damage == "data_with_header":
        msgs[0].data = msgs[1].data
    elif damage == "record_past_the_end":
        msgs[1].offset = 10**9
    ack = await push(stub, msgs)
    assert (ack.accepted, ack.code) == (False, code), ack.message
    info = await stub.GetVersion(ws.VersionRequest())
    assert (info.version, info.torn) == (old, False) and engine.version == old
    assert all(torch.equal(v, before[k]) for k, v in backend.model.state_dict().items())
    assert await asyncio.wait_for(greedy(engine), 30)  # still serving


@pytest.mark.parametrize("damage", ["flip_last_record", "drop_record", "wrong_count", "cut", "stall"])
async def test_a_push_broken_mid_stream_tears_the_engine_until_a_full_push(
    rig: dict[str, Any], backend: HFBackend, damage: str
) -> None:
    engine, stub, token = rig["engine"], rig["stub"], rig["token"]
    good = snapshot(perturbed(backend, 6), engine.version + 1)
    assert (await push(stub, frames(good, token=token))).accepted
    old = engine.version
    msgs = frames(snapshot(perturbed(backend, 7), old + 1), token=token, base=good)
    if damage == "flip_last_record":
        data = bytearray(msgs[-1].data)
        data[0] ^= 0xFF
        msgs[-1].data = bytes(data)
    elif damage == "drop_record":
        del msgs[2]
    elif damage == "wrong_count":
        msgs[0].header.num_chunks += 3
    if damage == "cut":
        await push_and_vanish(rig["addr"], msgs, 4)
    elif damage == "stall":  # the engine stops waiting after its record timeout (2 s here)
        ack = await push_and_stall(rig["addr"], msgs, 4)
        assert (ack.accepted, ack.code) == (False, "timeout"), ack.message
    else:
        ack = await push(stub, msgs)
        assert not ack.accepted
    async with asyncio.timeout(10):  # a cut stream reaches the engine a moment later
        while not (info := await stub.GetVersion(ws.VersionRequest())).torn:
            await asyncio.sleep(0.05)
    assert (info.version, info.torn, info.checksum) == (old, True, "")
    # a torn engine generates nothing...
    waiting = asyncio.ensure_future(greedy(engine))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    # ...refuses a delta, and is repaired by a full push, which lets the waiting request finish
    snap = snapshot(perturbed(backend, 8), old + 2)
    nack = await push(stub, frames(snap, token=token, base=good))
    assert (nack.accepted, nack.code) == (False, "base_mismatch") and "torn" in nack.message
    ack = await push(stub, frames(snap, token=token))
    assert ack.accepted, ack.message
    info = await stub.GetVersion(ws.VersionRequest())
    assert (info.version, info.torn, info.checksum) == (old + 2, False, snap.checksum)
    assert await asyncio.wait_for(waiting, 30)


async def test_a_relay_tree_reaches_every_engine_with_one_upload(
    backend: HFBackend, tiny_model: ModelConfig, store: OwnershipStore
) -> None:
    """Four engines, fan-out 1 (a chain): the trainer uploads the version once, every engine gets
    it, three of them through another engine; a dead engine in the chain costs its subtree a
    direct push, nothing else. Every engine checks the trainer's signature, relayed ones too."""
    key = new_signing_key()
    verifier = HeaderVerifier({"trainer-1": public_key(key)})
    servers, engines = [], []
    for i in range(4):
        b = backend if i == 0 else HFBackend(tiny_model, torch_threads=1, seed=i)
        if i:
            await b.start()
        eng = ContinuousEngine(b, max_batch=2)
        eng.start()
        servicer = WeightSyncServicer(eng, store, f"e{i}", verifier=verifier)
        server, port = await start_server(servicer, "127.0.0.1", 0)
        servers.append((server, port))
        engines.append(eng)
    lease = await store.acquire(TRAINER_ROLE, "trainer-1", 30)
    assert lease is not None
    addrs = [f"127.0.0.1:{p}" for _, p in servers]
    pusher = WeightPusher("trainer-1", CHUNK, retries=0, backoff_s=0.01, fanout=1, signer=HeaderSigner(key))
    try:
        snap = snapshot(perturbed(backend, 9), 1)
        results = await pusher.push(snap, lease.token, addrs)
        assert all(r.in_sync for r in results.values()), results
        assert pusher.last.probed == 1  # the whole version to all: one asked, for the token
        assert [results[a].via for a in addrs] == ["", addrs[0], addrs[0], addrs[0]]
        assert pusher.last.uploaded == pusher.last.dense_bytes  # one upload for four engines
        assert all(e.version == 1 and e.checksum == snap.checksum for e in engines)

        # deltas go down the same tree to the engines holding the base
        v2 = snapshot(perturbed(backend, 10), 2)
        results = await pusher.push(v2, lease.token, addrs, base=snap)
        assert all(r.in_sync for r in results.values()) and pusher.last.delta_engines == 4
        assert pusher.last.uploaded == pusher.last.delta_bytes and pusher.last.dense_bytes == 0
        assert pusher.last.probed == 0, "every engine's answer said it takes deltas: none is asked"

        # weights changed behind the pusher's back (a restarted engine): the delta it sends from
        # what it last left there is refused, and the whole version follows
        assert await engines[3].swap_weights(perturbed(backend, 12), 5, "elsewhere")
        v2b = snapshot(perturbed(backend, 13), 6)
        results = await pusher.push(v2b, lease.token, addrs, base=v2)
        assert all(r.in_sync for r in results.values()), results
        assert pusher.last.probed == 0 and pusher.last.dense_bytes > 0
        assert all(e.version == 6 and e.checksum == v2b.checksum for e in engines)
        snap = v2b

        # the second engine of the chain is gone: the relay through it fails, and the engines
        # below it are pushed directly
        await servers[1][0].stop(grace=0)
        v3 = snapshot(perturbed(backend, 11), 7)
        results = await pusher.push(v3, lease.token, addrs)
        assert [results[a].in_sync for a in addrs] == [True, False, True, True]
        assert results[addrs[2]].via == "" and results[addrs[3]].via == ""
        assert [e.version for e in engines] == [7, 6, 7, 7]
    finally:
        await pusher.close()
        for server, _ in servers:
            await server.stop(grace=0)
        for e in engines:
            await e.close(timeout=5)
