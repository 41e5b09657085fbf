"""Pushes one weight version to every rollout engine over gRPC (`tensors-v1`, services/common/weights.py).

Per version the trainer takes one snapshot of its weights in the wire dtype (`training.push_dtype`)
and encodes it once per kind of receiver, with the records shared by every engine that gets them
(no per-engine copy):

- **sparse delta** for engines that hold exactly the previous pushed version (same checksum) and
  apply deltas: only the elements whose bits changed, as gaps + values, tensor by tensor where that
  is smaller than the dense slice; unchanged tensors are not sent at all;
- **dense** for the others (new, restarted, torn, or a backend that takes whole tensors only).

Engines of one kind form a relay tree of fan-out `push_fanout`: the trainer streams to the roots,
and every engine forwards each record to its children as it arrives, so the trainer's upload does
not grow with the number of engines. An engine a relay did not reach (a dead parent, a refused
delta) is pushed again directly, dense when the delta was refused. An engine that answers
`stale_version` for the very version we send already has it, which is as good as an ack.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from services.common.contracts import ws, ws_grpc
from services.common.grpc_auth import bearer_metadata
from services.common.logging import get_logger
from services.common.tls import TlsFiles, grpc_channel
from services.common.tracing import grpc_metadata
from services.common.weight_signing import HeaderSigner
from services.common.weights import FORMAT, ITEMSIZE, subtree
from services.learning.snapshot import Snapshot, raw_bytes

# Codes after which another attempt cannot help: we lost the lease, or the engine refuses the push.
_FINAL_CODES = {
    "stale_token",
    "stale_version",
    "malformed",
    "too_large",
    "unauthenticated",
    "unauthorized",
    "base_mismatch",
}

PUSH_METHOD = "/libra.v1.WeightSync/PushWeights"
_BITS = {4: torch.int32, 2: torch.int16}


def _as_is(b: bytes) -> bytes:
    return b


@dataclass
class Encoded:
    """One version for one kind of receiver: the header fields and the records, serialized once
    and shared by every stream. A dense encoding is made while it streams (`lazy_dense`): the
    first engine's stream waits for each record as the encoder thread makes it, the next ones
    reuse them."""

    version: int
    checksum: str
    specs: list[ws.TensorSpec]
    count: int
    total_bytes: int
    base_version: int = 0
    base_checksum: str = ""
    sparse_tensors: int = 0
    skipped_tensors: int = 0
    wire: list[bytes] = field(default_factory=list)
    produce: Callable[[], Iterator[bytes]] | None = None
    _task: Any = None
    _changed: Any = None

    @property
    def records(self) -> list[ws.WeightChunk]:
        """The records as messages (complete encodings only; tests and tools)."""
        if len(self.wire) != self.count:
            raise RuntimeError("the encoding is not complete")
        return [ws.WeightChunk.FromString(b) for b in self.wire]

    def header(
        self, fencing_token: int, sender_id: str, relay: Sequence[ws.RelayNode] = ()
    ) -> ws.WeightHeader:
        return ws.WeightHeader(
            version=self.version,
            total_bytes=self.total_bytes,
            num_chunks=self.count,
            checksum=self.checksum,
            fencing_token=fencing_token,
            sender_id=sender_id,
            format=FORMAT,
            tensors=self.specs,
            base_version=self.base_version,
            base_checksum=self.base_checksum,
            relay=list(relay),
        )

    async def stream(self) -> AsyncIterator[bytes]:
        """The serialized records in order, as soon as each exists."""
        if self.produce is not None and self._task is None:
            loop = asyncio.get_running_loop()
            self._changed = asyncio.Event()
            self._task = asyncio.ensure_future(asyncio.to_thread(self._make, loop))
        i = 0
        while i < self.count:
            while i >= len(self.wire):
                if self._task is None or (self._task.done() and i >= len(self.wire)):
                    if self._task is not None and self._task.exception() is not None:
                        raise RuntimeError(f"encoding failed: {self._task.exception()}")
                    raise RuntimeError(f"the encoding ended at record {i} of {self.count}")
                await self._changed.wait()
            yield self.wire[i]
            i += 1

    def _make(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.produce is not None
        for b in self.produce():
            loop.call_soon_threadsafe(self._add, b)
        loop.call_soon_threadsafe(self._add, None)

    def _add(self, b: bytes | None) -> None:
        if b is not None:
            self.wire.append(b)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


_DATA_TAG = bytes([(3 << 3) | 2])  # WeightChunk.data: field 3, length-delimited


def _record(
    index: int, tensor: int, offset: int, values: torch.Tensor, indices: bytes = b"", index_bytes: int = 0
) -> bytes:
    """One serialized WeightChunk, its data copied once, straight from the tensor's memory
    (protobuf takes fields in any order, so the data field is appended after the small ones)."""
    data = memoryview(raw_bytes(values)).cast("B")
    head = ws.WeightChunk(
        index=index,
        tensor=tensor,
        offset=offset,
        count=values.numel(),
        indices=indices,
        index_bytes=index_bytes,
        crc32=zlib.crc32(data, zlib.crc32(indices)) & 0xFFFFFFFF,
    ).SerializeToString()
    return b"".join((head, _DATA_TAG, _varint(len(data)), data))


def _dense_slices(snap: Snapshot, chunk_bytes: int) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for i, t in enumerate(snap.tensors):
        step = max(1, chunk_bytes // t.element_size())
        out.extend((i, a, min(step, t.numel() - a)) for a in range(0, t.numel(), step))
    return out


def lazy_dense(snap: Snapshot, chunk_bytes: int) -> Encoded:
    """The whole version, records made as the first stream asks for them."""
    slices = _dense_slices(snap, chunk_bytes)

    def produce() -> Iterator[bytes]:
        for k, (i, a, n) in enumerate(slices):
            yield _record(k, i, a, snap.tensors[i][a : a + n])

    return Encoded(snap.version, snap.checksum, snap.specs(), len(slices), snap.nbytes, produce=produce)


def encode_dense(snap: Snapshot, chunk_bytes: int) -> Encoded:
    enc = lazy_dense(snap, chunk_bytes)
    assert enc.produce is not None
    enc.wire, enc.produce = list(enc.produce()), None
    return enc


def _sparse(
    tensor: int, flat: torch.Tensor, idx: torch.Tensor, chunk_bytes: int
) -> list[tuple[int, int, torch.Tensor, bytes, int]]:
    """(tensor, offset, values, indices, index bytes) pieces: gap-coded indices, else absolute."""
    step = max(1, chunk_bytes // (flat.element_size() + 2))
    out = []
    for a in range(0, idx.numel(), step):
        part = idx[a : a + step]
        first = int(part[0])
        gaps = torch.diff(part, prepend=part[:1])
        if int(gaps.max()) <= 0xFFFF:
            coded, width = raw_bytes(gaps.to(torch.int32).to(torch.int16)).tobytes(), 2
        elif flat.numel() < 2**31:
            coded, width = raw_bytes(part.to(torch.int32)).tobytes(), 4
        else:
            coded, width = raw_bytes(part).tobytes(), 8
        out.append((tensor, first, flat[part], coded, width))
    return out


def encode_delta(base: Snapshot, snap: Snapshot, chunk_bytes: int) -> Encoded:
    """The changes from `base` to `snap`: per tensor, nothing when no bit changed, the changed
    elements when that is smaller than the tensor, else the tensor dense."""
    if base.names != snap.names or base.shapes != snap.shapes or base.dtype != snap.dtype:
        raise ValueError("a delta needs the same tensors, shapes and dtype as its base")
    pieces: list[tuple[int, int, torch.Tensor, bytes, int]] = []
    sparse = skipped = 0
    itemsize = ITEMSIZE[snap.dtype]
    for i, (old, new) in enumerate(zip(base.tensors, snap.tensors, strict=True)):
        bits = _BITS[itemsize]
        idx = torch.nonzero(old.view(bits) != new.view(bits)).view(-1)
        if idx.numel() == 0:
            skipped += 1
        elif idx.numel() * (itemsize + 2) < new.numel() * itemsize:
            pieces.extend(_sparse(i, new, idx, chunk_bytes))
            sparse += 1
        else:
            step = max(1, chunk_bytes // itemsize)
            pieces.extend((i, a, new[a : a + step], b"", 0) for a in range(0, new.numel(), step))
    wire = [_record(k, i, a, v, ix, w) for k, (i, a, v, ix, w) in enumerate(pieces)]
    total = sum(v.numel() * itemsize + len(ix) for _, _, v, ix, _ in pieces)
    return Encoded(
        snap.version,
        snap.checksum,
        snap.specs(),
        len(wire),
        total,
        base.version,
        base.checksum,
        sparse,
        skipped,
        wire=wire,
    )


def relay_tree(addrs: Sequence[str], fanout: int) -> list[ws.RelayNode]:
    """The trainer's direct children in a complete `fanout`-ary tree over `addrs` in order: the
    trainer sends to `fanout` engines, engine i forwards to engines fanout·(i+1) + j, j < fanout
    (0: every engine directly from the trainer)."""
    nodes = [ws.RelayNode(addr=a) for a in addrs]
    if fanout <= 0:
        return nodes
    # bottom-up, so each child is complete before it is copied into its parent
    for i in range(len(nodes) - 1, -1, -1):
        first = fanout * (i + 1)
        nodes[i].children.extend(nodes[first : first + fanout])
    return nodes[:fanout]


@dataclass(frozen=True)
class PushResult:
    addr: str
    in_sync: bool
    """The engine holds `version` now (accepted, or already had it)."""
    code: str
    message: str
    bytes: int
    seconds: float
    attempts: int
    via: str = ""
    """The engine the trainer streamed to whose relay tree carried it ('' when the trainer pushed
    it to this engine itself)."""
    accepts_deltas: bool | None = None
    """What the engine's answer said of it (PushAck.accepts_deltas); None: it did not answer."""


@dataclass
class PushStats:
    """What one version's push cost: the bytes the trainer itself uploaded, per encoding."""

    uploaded: int = 0
    dense_bytes: int = 0
    delta_bytes: int = 0
    delta_engines: int = 0
    probed: int = 0
    """Engines asked their weights first (those this pusher had not last left in sync)."""
    encodings: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineState:
    version: int
    checksum: str
    torn: bool
    accepts_deltas: bool


class WeightPusher:
    def __init__(
        self,
        sender_id: str,
        chunk_bytes: int,
        *,
        retries: int = 3,
        backoff_s: float = 0.5,
        timeout_s: float = 300.0,
        token: str | None = None,
        tls: TlsFiles | None = None,
        fanout: int = 2,
        signer: HeaderSigner | None = None,
    ):
        """`signer` (the trainer identity's key) signs every header: engines given the trainers'
        public keys take no push without it."""
        self.sender_id = sender_id
        self.signer = signer
        self.tls = tls
        self._auth = bearer_metadata(token)
        self.chunk_bytes = chunk_bytes
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.fanout = fanout
        self.log = get_logger(component="weight_push")
        self.last = PushStats()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._encoded: dict[tuple[int, int], Encoded] = {}
        self._known: dict[str, EngineState] = {}
        """What each engine held after this pusher's last push that reached it: the next push
        asks only the others (at 1,024 engines, asking each one's version every step took the
        trainer seconds). An engine whose weights changed since (a restart) refuses the delta as
        `base_mismatch` and is sent the whole version."""
        limit = max(8 << 20, chunk_bytes + (1 << 20))
        self._options = [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ]

    def _header(self, enc: Encoded, token: int, relay: Sequence[ws.RelayNode]) -> ws.WeightHeader:
        header = enc.header(token, self.sender_id, relay)
        return self.signer.sign(header) if self.signer is not None else header

    def _channel(self, addr: str) -> grpc.aio.Channel:
        ch = self._channels.get(addr)
        if ch is None:
            ch = grpc_channel(addr, self.tls, self._options)
            self._channels[addr] = ch
        return ch

    def _stub(self, addr: str) -> ws_grpc.WeightSyncStub:
        return ws_grpc.WeightSyncStub(self._channel(addr))

    def _push_call(self, addr: str) -> Any:
        """PushWeights taking records already serialized (each made once, sent to many)."""
        return self._channel(addr).stream_unary(
            PUSH_METHOD, request_serializer=_as_is, response_deserializer=ws.PushAck.FromString
        )

    async def encoded(self, snap: Snapshot, base: Snapshot | None = None) -> Encoded:
        """Encodes once per (version, base) and keeps the last few: every engine shares the records."""
        key = (snap.version, base.version if base is not None else 0)
        if key not in self._encoded:
            start = time.perf_counter()
            if base is None:
                enc = lazy_dense(snap, self.chunk_bytes)  # made while the first stream sends it
            else:
                enc = await asyncio.to_thread(encode_delta, base, snap, self.chunk_bytes)
                self.last.encodings["delta"] = time.perf_counter() - start
            self._encoded = {k: v for k, v in self._encoded.items() if k[0] == snap.version}
            self._encoded[key] = enc
        return self._encoded[key]

    async def push(
        self, snap: Snapshot, fencing_token: int, addrs: Sequence[str], base: Snapshot | None = None
    ) -> dict[str, PushResult]:
        """Pushes `snap` to all `addrs`: a delta from `base` to the engines that hold it, dense to
        the rest, each kind down its relay tree; never raises for an engine's failure, reports it."""
        self.last = PushStats()
        unknown = [a for a in addrs if a not in self._known]
        probes: dict[str, EngineState | str | None] = {a: self._known[a] for a in addrs if a in self._known}
        # with no base every engine gets the whole version whatever it holds: one is asked first
        # (a wrong token is refused there, cleanly), all of them only if it refuses; what each
        # takes next time its answer to the push says (at 1,024 engines, 1,024 calls saved)
        asked = unknown if base is not None else unknown[:1]
        probes.update(await asyncio.gather(*(self._probe(a) for a in asked)))
        if base is None and any(isinstance(probes[a], str) for a in asked):
            asked = unknown
            probes.update(await asyncio.gather(*(self._probe(a) for a in unknown[1:])))
        for a in unknown:
            probes.setdefault(a, None)
        self.last.probed = len(asked)
        results: dict[str, PushResult] = {}
        delta_addrs, dense_addrs = [], []
        for addr in addrs:
            state = probes[addr]
            if isinstance(state, str):  # refused our token: another attempt cannot help
                results[addr] = PushResult(addr, False, "unauthenticated", state, 0, 0.0, 1)
                self.log.warning(
                    "weights_push_failed", engine=addr, version=snap.version, code="unauthenticated"
                )
            elif (
                base is not None
                and state is not None
                and state.accepts_deltas
                and not state.torn
                and (state.version, state.checksum) == (base.version, base.checksum)
            ):
                delta_addrs.append(addr)
            else:
                dense_addrs.append(addr)
        if delta_addrs and base is not None:
            enc = await self.encoded(snap, base)
            self.last.delta_bytes, self.last.delta_engines = enc.total_bytes, len(delta_addrs)
            results.update(await self._push_group(enc, delta_addrs, fencing_token))
        refused = [a for a in delta_addrs if results[a].code == "base_mismatch"]
        if dense_addrs or refused:
            enc = await self.encoded(snap)
            self.last.dense_bytes = enc.total_bytes
            results.update(await self._push_group(enc, dense_addrs, fencing_token))
            for a in refused:  # its weights were not what it said a moment ago: the whole version
                results[a] = await self._push_one(a, enc, fencing_token)
        for addr, r in results.items():  # every answer says what the engine takes
            if r.in_sync and r.accepts_deltas is not None:
                self._known[addr] = EngineState(snap.version, snap.checksum, False, r.accepts_deltas)
            else:  # asked again next time
                self._known.pop(addr, None)
        return results

    async def _push_group(self, enc: Encoded, addrs: Sequence[str], token: int) -> dict[str, PushResult]:
        """Down the relay tree, then directly to every engine the tree did not reach."""
        if not addrs:
            return {}
        roots = relay_tree(addrs, self.fanout)
        answers = await asyncio.gather(*(self._push_one(r.addr, enc, token, list(r.children)) for r in roots))
        results: dict[str, PushResult] = {}
        for root, res in zip(roots, answers, strict=True):
            results.update(res.relayed if isinstance(res, _TreeResult) else {root.addr: res})
        retry = [
            a
            for a in addrs
            if not results[a].in_sync and results[a].code not in _FINAL_CODES and results[a].via
        ]
        for r in await asyncio.gather(*(self._push_one(a, enc, token) for a in retry)):
            results[r.addr] = r
        return results

    async def _probe(self, addr: str) -> tuple[str, EngineState | str | None]:
        """The engine's weights (version, checksum, torn, deltas), asked first: a wrong token is
        refused here, cleanly, where a push the server aborts mid-stream can surface as a
        transient INTERNAL error and be retried. None when it does not answer (the push will tell)."""
        try:
            info = await self._stub(addr).GetVersion(ws.VersionRequest(), metadata=self._auth, timeout=10)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                return addr, f"UNAUTHENTICATED: {err.details()}"
            return addr, None
        return addr, EngineState(int(info.version), info.checksum, info.torn, info.accepts_deltas)

    async def _push_one(
        self, addr: str, enc: Encoded, token: int, relay: list[ws.RelayNode] | None = None
    ) -> Any:
        """One stream to `addr` (forwarding to `relay`), with retries; a _TreeResult when it relays."""
        start = time.perf_counter()
        code, message = "unavailable", ""
        attempt = 0
        below = [a for n in relay or [] for a in subtree(n)]
        for attempt in range(1, self.retries + 2):
            try:
                ack = await self._push_call(addr)(
                    self._stream(self._header(enc, token, relay or []), enc),
                    metadata=grpc_metadata() + self._auth,
                    timeout=self.timeout_s,
                )
                self.last.uploaded += enc.total_bytes
                code, message = ack.code or ("ok" if ack.accepted else "internal"), ack.message
                ok = ack.accepted or (code == "stale_version" and ack.version == enc.version)
                if ok or code in _FINAL_CODES:
                    seconds = time.perf_counter() - start
                    own = PushResult(
                        addr,
                        ok,
                        code,
                        message,
                        enc.total_bytes if ok else 0,
                        seconds,
                        attempt,
                        accepts_deltas=ack.accepts_deltas,
                    )
                    if not below:
                        return own
                    return _TreeResult.of(own, ack, below, enc, seconds)
            except grpc.aio.AioRpcError as err:
                message = f"{err.code().name}: {err.details()}"
                if err.code() == grpc.StatusCode.UNAUTHENTICATED:  # a wrong token stays wrong
                    code = "unauthenticated"
                    break
                code = "unavailable"
            self.log.warning(
                "weights_push_retry",
                engine=addr,
                version=enc.version,
                attempt=attempt,
                code=code,
                reason=message[:200],
            )
            if attempt <= self.retries:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
        self.log.warning("weights_push_failed", engine=addr, version=enc.version, code=code, reason=message)
        own = PushResult(addr, False, code, message, 0, time.perf_counter() - start, attempt)
        if not below:
            return own
        return _TreeResult.of(own, None, below, enc, time.perf_counter() - start)

    async def versions(self, addrs: Sequence[str]) -> dict[str, int]:
        """The weight version each engine says it serves (those that answered); a torn engine
        serves none (-1) until a full push lands."""
        answers = await asyncio.gather(*(self._probe(a) for a in addrs))
        return {a: (-1 if s.torn else s.version) for a, s in answers if isinstance(s, EngineState)}

    @staticmethod
    async def _stream(header: ws.WeightHeader, enc: Encoded) -> AsyncIterator[bytes]:
        yield ws.WeightChunk(header=header).SerializeToString()
        async for b in enc.stream():
            yield b

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()


@dataclass(frozen=True)
class _TreeResult:
    relayed: dict[str, PushResult]

    @classmethod
    def of(
        cls, own: PushResult, ack: ws.PushAck | None, below: list[str], enc: Encoded, seconds: float
    ) -> _TreeResult:
        out = {own.addr: own}
        answered = {r.addr: r for r in (ack.relayed if ack is not None else [])}
        for a in below:
            r = answered.get(a)
            if r is None:
                out[a] = PushResult(
                    a, False, "unavailable", f"not reached through {own.addr}", 0, seconds, 1, own.addr
                )
                continue
            ok = r.accepted or (r.code == "stale_version" and r.version == enc.version)
            out[a] = PushResult(
                a,
                ok,
                r.code,
                r.message,
                enc.total_bytes if ok else 0,
                seconds,
                1,
                own.addr,
                accepts_deltas=r.accepts_deltas,
            )
        return cls(out)
