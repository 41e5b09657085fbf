"""WeightSync gRPC server: the trainer streams a weight version (`tensors-v1`), the engine checks
each record and applies it as it arrives, forwarding the stream to the engines below it.

Everything that can be checked before a byte is written is checked first, and a push that fails
there changes nothing: the bearer token (interceptor), the header (format, sizes, dtypes, a
manifest that names this model's tensors with their shapes), the trainer's signature over it
(services/common/weight_signing.py), the sender's fencing token (the live trainer lease, held by
the signer, not below the highest seen), a version newer than the engine's, and for a sparse
delta that the engine holds exactly its base (version and checksum). Generation then pauses and
the records are applied one by one, each after its framing and crc32 check, so the engine holds at
most one record beyond its own weights. At the end the engine recomputes the sha256 of what it
holds (the header's `checksum`: bit-identical or refused), checks the fencing token again, and
takes the version.

A push that fails after the first write (the stream cut, a record damaged, the state checksum
wrong) leaves the weights **torn**: neither version. The engine then reports `torn`, generates
nothing, and refuses deltas until a full push lands; the trainer's resync sends one within
`resync_interval_s`. Emulated engines hold no tensors: they check the records and drop them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from services.common.contracts import ws, ws_grpc
from services.common.grpc_auth import BearerTokenInterceptor, bearer_metadata
from services.common.logging import get_logger
from services.common.membership import TRAINER_ROLE
from services.common.ownership import OwnershipStore
from services.common.tls import TlsFiles, grpc_channel
from services.common.tracing import context_from_grpc, grpc_metadata, tracer
from services.common.weight_signing import HeaderVerifier, SignatureError
from services.common.weights import (
    FORMAT,
    ITEMSIZE,
    RecordError,
    check_record,
    check_specs,
    numel,
    payload_bytes,
    record_indices,
    subtree,
    tensor_of,
    torch_dtype,
)
from services.generation.backends.base import Engine

MAX_MESSAGE_BYTES = 64 << 20
RELAY_QUEUE = 2
"""Records buffered per child of a relay: a slow child slows its parent, and a relaying engine
holds at most this many records per child beyond its own."""
M_ARENA_MAX = -8  # glibc mallopt parameter


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Caps glibc's malloc arenas (call before threads start). A push moves the model through
    this process in MB-sized records allocated and freed by the event loop, the gRPC threads and
    the apply worker; with one arena per thread (glibc's default: up to 8 per core) the freed
    records stay spread over arenas and the engine's RSS grows by tens of MB per push. False
    where there is no glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


class PushRejected(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Writer:
    """Where a push's records go. This base keeps nothing (emulated engines): it counts, and can
    vouch for the state checksum only of a full push whose records came in order."""

    accepts_deltas = True

    def __init__(self, specs: Sequence[ws.TensorSpec], delta: bool):
        self.specs = specs
        self.delta = delta
        self.applied = 0
        self._digest = hashlib.sha256()
        self._cursor = (0, 0)

    async def write(self, chunk: ws.WeightChunk, spec: ws.TensorSpec) -> None:
        self._follow(chunk)

    def _follow(self, chunk: ws.WeightChunk) -> None:
        """Hashes the data of dense records that continue exactly where the last one ended."""
        if chunk.indices or self._cursor is None:
            self._cursor = None  # type: ignore[assignment]
            return
        t, off = self._cursor
        while t < len(self.specs) and off == numel(self.specs[t]):
            t, off = t + 1, 0
        if (chunk.tensor, chunk.offset) != (t, off):
            self._cursor = None  # type: ignore[assignment]
            return
        self._digest.update(chunk.data)
        self._cursor = (t, off + chunk.count)

    async def checksum(self) -> str | None:
        """sha256 of the state now held, or None when this writer cannot tell."""
        if self.delta or self._cursor is None:
            return None
        t, off = self._cursor
        covered = sum(numel(s) for s in self.specs[:t]) + off
        return self._digest.hexdigest() if covered == sum(numel(s) for s in self.specs) else None


class InPlaceWriter(Writer):
    """Writes straight into the model's tensors (the hf backend): dense slices are copied, sparse
    records scattered; the state checksum is recomputed from the tensors, slice by slice."""

    def __init__(self, specs: Sequence[ws.TensorSpec], delta: bool, slots: dict[str, Any]):
        super().__init__(specs, delta)
        import torch

        self.torch = torch
        self.flat = []
        storages: dict[tuple[int, int], str] = {}
        for s in specs:
            slot = slots.get(s.name)
            if slot is None:
                raise RecordError("malformed", f"unknown weight name {s.name!r}")
            if tuple(slot.shape) != tuple(s.shape):
                raise RecordError(
                    "malformed", f"shape mismatch for {s.name}: {list(s.shape)} vs {list(slot.shape)}"
                )
            if not slot.is_contiguous():
                raise RecordError("internal", f"{s.name} is not contiguous here")
            where = (slot.untyped_storage().data_ptr(), int(slot.storage_offset()))
            if where in storages:  # tied here: two writers of one tensor could never both hold
                raise RecordError("malformed", f"{s.name} and {storages[where]} are one tensor here (tied)")
            storages[where] = s.name
            self.flat.append(slot.view(-1))

    def _indices(self, chunk: ws.WeightChunk, n: int) -> Any:
        idx = record_indices(chunk.indices, chunk.index_bytes, chunk.offset)
        if int(idx.min()) < 0 or int(idx.max()) >= n:
            raise RecordError("malformed", f"record {chunk.index}: sparse indices outside the tensor")
        return idx

    async def write(self, chunk: ws.WeightChunk, spec: ws.TensorSpec) -> None:
        self.write_now(chunk, spec)

    def write_now(self, chunk: ws.WeightChunk, spec: ws.TensorSpec) -> None:
        """Blocking (a worker thread may run it): torch's copy and hashlib release the GIL."""
        self._follow(chunk)
        flat = self.flat[chunk.tensor]
        values = tensor_of(chunk.data, spec.dtype)
        with self.torch.no_grad():
            if chunk.indices:
                idx = self._indices(chunk, flat.numel())
                self.applied += 1
                flat[idx] = values.to(flat.dtype)
            else:
                self.applied += 1
                flat[chunk.offset : chunk.offset + chunk.count].copy_(values)

    async def checksum(self) -> str | None:
        """A full push whose records covered every element in order was hashed as it was
        written (the copy into the tensors is exact, bf16 into fp32 included); anything else is
        hashed again from the tensors."""
        streamed = await super().checksum()
        return streamed if streamed is not None else await asyncio.to_thread(self._checksum)

    def _checksum(self) -> str:
        torch = self.torch
        h = hashlib.sha256()
        for spec, flat in zip(self.specs, self.flat, strict=True):
            wire = torch_dtype(spec.dtype)
            step = max(1, (8 << 20) // ITEMSIZE[spec.dtype])
            for a in range(0, flat.numel(), step):
                piece = flat[a : a + step]
                if piece.dtype != wire:
                    piece = piece.to(wire)
                h.update(piece.contiguous().view(torch.uint8).numpy())
        return h.hexdigest()


class AssemblingWriter(Writer):
    """For a backend that loads whole tensors (vllm): each tensor is assembled from its dense
    records, in order, and handed over the moment it is complete, so at most one tensor waits."""

    accepts_deltas = False

    def __init__(self, specs: Sequence[ws.TensorSpec], delta: bool, backend: Any):
        if delta:
            raise RecordError("base_mismatch", "this engine takes full pushes only")
        super().__init__(specs, delta)
        self.backend = backend
        self._parts: list[bytes] = []
        self._have = 0

    async def write(self, chunk: ws.WeightChunk, spec: ws.TensorSpec) -> None:
        if chunk.indices or chunk.offset != self._have:
            raise RecordError("malformed", f"record {chunk.index}: out of order for a whole-tensor load")
        self._follow(chunk)
        self._parts.append(chunk.data)
        self._have += chunk.count
        if self._have == numel(spec):
            whole = b"".join(self._parts)
            self._parts, self._have = [], 0
            self.applied += 1
            await self.backend.load_tensors([(spec.name, tensor_of(whole, spec.dtype).view(*spec.shape))])

    async def checksum(self) -> str | None:
        """The sha256 of what the backend serves now, read back from its tensors where it can
        (vllm: by the pushed names, out of its fused layout, once the reload is processed); else
        of the records as received."""
        served = getattr(self.backend, "served_checksum", None)
        got = await served(self.specs) if served is not None else None
        return got if got is not None else await super().checksum()


class RemoteInPlaceWriter(Writer):
    """For a backend whose tensors live in another process and can be written there in place
    (vllm, one GPU or CPU, whose worker maps Hugging Face names onto its fused layout): each
    record, dense or sparse, is sent to the backend as it arrives and written into the served
    tensors, so sparse deltas cost only their changed elements on the wire and in the engine."""

    def __init__(self, specs: Sequence[ws.TensorSpec], delta: bool, backend: Any):
        super().__init__(specs, delta)
        self.backend = backend

    async def write(self, chunk: ws.WeightChunk, spec: ws.TensorSpec) -> None:
        self._follow(chunk)
        record = (
            spec.name,
            list(spec.shape),
            spec.dtype,
            chunk.offset,
            chunk.count,
            chunk.indices,
            chunk.index_bytes,
            chunk.data,
        )
        try:
            await self.backend.write_records([record])
        except ValueError as err:
            raise RecordError("malformed", f"record {chunk.index}: {err}") from None
        self.applied += 1

    async def checksum(self) -> str | None:
        """The sha256 of what the backend serves now, read back by the pushed names."""
        got = await self.backend.served_checksum(self.specs)
        return got if got is not None else await super().checksum()


class Relay:
    """Forwards one push, record by record as it arrives, to this engine's children in the relay
    tree (each with its own subtree), and collects what they and their subtrees answered."""

    def __init__(
        self, header: ws.WeightHeader, token: str | None, tls: TlsFiles | None, timeout_s: float
    ) -> None:
        self.log = get_logger(component="weight_relay")
        self.tasks: list[tuple[ws.RelayNode, asyncio.Queue[ws.WeightChunk | None], asyncio.Task[Any]]] = []
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
        self.channels = []
        for node in header.relay:
            child = ws.WeightHeader()
            child.CopyFrom(header)
            del child.relay[:]
            child.relay.extend(node.children)
            q: asyncio.Queue[ws.WeightChunk | None] = asyncio.Queue(RELAY_QUEUE)
            ch = grpc_channel(node.addr, tls, options)
            self.channels.append(ch)
            call = ws_grpc.WeightSyncStub(ch).PushWeights(
                _drain(child, q), metadata=grpc_metadata() + bearer_metadata(token), timeout=timeout_s
            )
            self.tasks.append((node, q, asyncio.ensure_future(call)))

    async def forward(self, chunk: ws.WeightChunk | None) -> None:
        for _, q, task in self.tasks:
            if task.done():
                continue  # that child failed: its subtree is reported, the rest goes on
            put = asyncio.ensure_future(q.put(chunk))
            await asyncio.wait({put, task}, return_when=asyncio.FIRST_COMPLETED)
            if not put.done():
                put.cancel()

    async def results(self) -> list[ws.RelayResult]:
        await self.forward(None)
        out: list[ws.RelayResult] = []
        for node, _, task in self.tasks:
            try:
                ack = await task
                out.append(
                    ws.RelayResult(
                        addr=node.addr,
                        accepted=ack.accepted,
                        version=ack.version,
                        code=ack.code,
                        message=ack.message,
                        accepts_deltas=ack.accepts_deltas,
                    )
                )
                out.extend(ack.relayed)
            except Exception as err:  # the child is away: its whole subtree missed this push
                why = f"relay from this engine failed: {err}"[:300]
                out.extend(ws.RelayResult(addr=a, code="unavailable", message=why) for a in subtree(node))
        for ch in self.channels:
            await ch.close()
        return out

    async def abort(self) -> None:
        for _, _, task in self.tasks:
            task.cancel()
        for ch in self.channels:
            await ch.close()


def _check_and_write(writer: InPlaceWriter, chunk: ws.WeightChunk, specs: Sequence[ws.TensorSpec]) -> None:
    writer.write_now(chunk, check_record(chunk, specs))


async def _drain(
    header: ws.WeightHeader, q: asyncio.Queue[ws.WeightChunk | None]
) -> AsyncIterator[ws.WeightChunk]:
    yield ws.WeightChunk(header=header)
    while (chunk := await q.get()) is not None:
        yield chunk


class WeightSyncServicer(ws_grpc.WeightSyncServicer):
    def __init__(
        self,
        engine: Engine,
        store: OwnershipStore,
        engine_id: str,
        max_push_bytes: int = 64 << 30,
        keep_tensors: bool = True,
        relay_token: str | None = None,
        relay_tls: TlsFiles | None = None,
        relay_timeout_s: float = 300.0,
        record_timeout_s: float = 30.0,
        verifier: HeaderVerifier | None = None,
    ):
        """`keep_tensors=False` (emulated engines) checks every record and keeps none, so the
        engine never imports torch. `relay_token` and `relay_tls` are this engine's own
        credentials for forwarding a push to its children. With a `verifier` (the trainers'
        public keys) a push is taken only when a trainer signed its header and that trainer holds
        the trainer lease with the header's fencing token; without one (a stack without
        credentials) the header's sender is taken at its word."""
        self.engine = engine
        self.keep_tensors = keep_tensors
        self.max_push_bytes = max_push_bytes
        self.store = store
        self.engine_id = engine_id
        self.relay_token, self.relay_tls, self.relay_timeout_s = relay_token, relay_tls, relay_timeout_s
        self.record_timeout_s = record_timeout_s
        self.verifier = verifier
        self.highest_token = 0
        self.refused: dict[str, int] = {}
        """Pushes refused since the engine started, by code (GetVersion reports them)."""
        self.log = get_logger(component="weight_sync")

    def _slots(self) -> dict[str, Any] | None:
        backend = getattr(self.engine, "backend", None)
        slots = getattr(backend, "weight_slots", None)
        return slots() if callable(slots) else None

    def _in_place(self) -> Any:
        """The backend, where it writes records into tensors it serves from another process."""
        backend = getattr(self.engine, "backend", None)
        return backend if getattr(backend, "in_place_deltas", False) else None

    @property
    def accepts_deltas(self) -> bool:
        return not self.keep_tensors or self._slots() is not None or self._in_place() is not None

    async def GetVersion(self, request: ws.VersionRequest, context: Any) -> ws.VersionInfo:
        return ws.VersionInfo(
            engine_id=self.engine_id,
            version=self.engine.version,
            checksum=self.engine.checksum,
            torn=self.engine.torn,
            accepts_deltas=self.accepts_deltas,
            pushes_refused=self.refused,
        )

    async def PushWeights(self, request_iterator: Any, context: Any) -> ws.PushAck:
        ctx = context_from_grpc(context.invocation_metadata())
        with tracer().start_as_current_span("weights.apply", context=ctx) as span:
            span.set_attribute("libra.engine_id", self.engine_id)
            started = time.monotonic()
            relayed: list[ws.RelayResult] = []
            try:
                header, relayed = await self._receive(request_iterator.__aiter__(), span)
            except PushRejected as err:
                span.set_attribute("libra.push_code", err.code)
                self.refused[err.code] = self.refused.get(err.code, 0) + 1
                self.log.warning("weights_rejected", code=err.code, reason=str(err), torn=self.engine.torn)
                return ws.PushAck(
                    accepted=False,
                    version=self.engine.version,
                    code=err.code,
                    message=str(err),
                    accepts_deltas=self.accepts_deltas,
                )
            except Exception as err:  # the boundary: a bad push must never take the server down
                self.log.exception("weights_push_failed")
                return ws.PushAck(
                    accepted=False,
                    version=self.engine.version,
                    code="internal",
                    message=f"{type(err).__name__}: {err}",
                )
            apply_s = time.monotonic() - started
            self.log.info(
                "weights_applied",
                policy_version=header.version,
                bytes=header.total_bytes,
                delta_from=header.base_version,
                sender=header.sender_id,
                relayed=len(relayed),
                apply_s=round(apply_s, 4),
            )
            return ws.PushAck(
                accepted=True,
                version=header.version,
                code="ok",
                apply_s=apply_s,
                relayed=relayed,
                accepts_deltas=self.accepts_deltas,
            )

    async def _receive(self, it: Any, span: Any) -> tuple[ws.WeightHeader, list[ws.RelayResult]]:
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise PushRejected("malformed", "empty stream") from None
        if not first.HasField("header"):
            raise PushRejected("malformed", "first message carries no header")
        header = first.header
        self._check_header(header)
        if first.data or first.indices:
            raise PushRejected("malformed", "the header travels alone in the first message")
        if self.verifier is not None:
            try:
                self.verifier.verify(header)
            except SignatureError as err:
                raise PushRejected("unauthorized", str(err)) from None
        await self._check_token(header.fencing_token, header.sender_id)
        if header.version <= self.engine.version:
            raise PushRejected("stale_version", f"version {header.version} <= current {self.engine.version}")
        writer = await self._writer(header)
        span.set_attribute("libra.policy_version", header.version)
        span.set_attribute("libra.delta_from", header.base_version)
        relay = (
            Relay(header, self.relay_token, self.relay_tls, self.relay_timeout_s) if header.relay else None
        )
        try:
            swapped = await self.engine.apply_update(
                header.version,
                header.checksum.lower(),
                lambda: self._apply(it, header, writer, relay),
                lambda: writer.applied > 0,
            )
        except BaseException as err:
            if relay is not None:  # its children see the stream end early and refuse it
                await relay.abort()
            if isinstance(err, RecordError):
                raise PushRejected(err.code, str(err)) from None
            raise
        relayed = await relay.results() if relay is not None else []
        if not swapped:
            raise PushRejected("stale_version", f"version {header.version} <= current {self.engine.version}")
        self.highest_token = max(self.highest_token, header.fencing_token)
        return header, relayed

    async def _apply(self, it: Any, header: ws.WeightHeader, writer: Writer, relay: Relay | None) -> None:
        """Runs with generation paused: every record checked, forwarded, applied; then the totals,
        the state checksum and the fencing token. Raises RecordError or PushRejected."""
        received = records = 0
        pending: asyncio.Future[None] | None = None
        while True:
            try:  # generation is paused: a sender that stalls must not hold it for long
                chunk = await asyncio.wait_for(it.__anext__(), self.record_timeout_s)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise RecordError(
                    "timeout",
                    f"no record for {self.record_timeout_s:.0f}s after record {records}: the sender stalled",
                ) from None
            if relay is not None:
                await relay.forward(chunk)
            records += 1
            received += payload_bytes(chunk)
            if received > header.total_bytes or records > header.num_chunks:
                raise RecordError("checksum_mismatch", "more records or bytes than the header says")
            if pending is not None:
                await pending  # one record in the worker while the next one arrives
            pending = self._write(writer, chunk, header.tensors)
        if pending is not None:
            await pending
        if records != header.num_chunks or received != header.total_bytes:
            raise RecordError(
                "checksum_mismatch",
                f"got {records} records / {received} bytes, header says {header.num_chunks} / {header.total_bytes}",
            )
        got = await writer.checksum()
        if got is not None and got != header.checksum.lower():
            raise RecordError(
                "checksum_mismatch", "the weights after the push differ from the sender's (sha256)"
            )
        await self._check_token(header.fencing_token, header.sender_id)

    @staticmethod
    def _write(writer: Writer, chunk: ws.WeightChunk, specs: Sequence[ws.TensorSpec]) -> asyncio.Future[None]:
        """Checks a record and writes it: in a worker thread when the writer can (its crc32, copy
        and sha256 run beside the event loop receiving the next record), else on the loop."""
        if isinstance(writer, InPlaceWriter):
            return asyncio.ensure_future(asyncio.to_thread(_check_and_write, writer, chunk, specs))

        async def inline() -> None:
            await writer.write(chunk, check_record(chunk, specs))

        return asyncio.ensure_future(inline())

    async def _writer(self, header: ws.WeightHeader) -> Writer:
        delta = header.base_version != 0
        holds = (self.engine.version, self.engine.checksum)
        if delta and (self.engine.torn or (header.base_version, header.base_checksum.lower()) != holds):
            raise PushRejected(
                "base_mismatch",
                f"delta from version {header.base_version}, this engine holds {self.engine.version}"
                + (" (torn)" if self.engine.torn else ""),
            )
        try:
            if not self.keep_tensors:
                return Writer(header.tensors, delta)
            slots = self._slots()
            if slots is not None:
                return InPlaceWriter(header.tensors, delta, slots)
            remote = self._in_place()
            if delta and remote is not None:  # full pushes go through the library's own loader
                if not await remote.resolves(header.tensors):
                    raise PushRejected(
                        "base_mismatch", "a tensor of the delta has no place here: push it full"
                    )
                return RemoteInPlaceWriter(header.tensors, delta, remote)
            return AssemblingWriter(header.tensors, delta, getattr(self.engine, "backend", None))
        except RecordError as err:
            raise PushRejected(err.code, str(err)) from None

    def _check_header(self, h: ws.WeightHeader) -> None:
        if h.total_bytes > self.max_push_bytes:  # first: nothing of a push this large is read
            raise PushRejected(
                "too_large", f"total_bytes={h.total_bytes} > max_push_bytes={self.max_push_bytes}"
            )
        if h.format != FORMAT:
            raise PushRejected("malformed", f"unsupported format {h.format!r} (this engine speaks {FORMAT})")
        if h.version <= 0 or h.num_chunks < 0 or h.total_bytes < 0:
            raise PushRejected(
                "malformed", "version must be positive, num_chunks and total_bytes not negative"
            )
        if len(h.checksum) != 64 or any(c not in "0123456789abcdefABCDEF" for c in h.checksum):
            raise PushRejected("malformed", "checksum must be a sha256 hex digest")
        try:
            check_specs(h.tensors)
        except RecordError as err:
            raise PushRejected(err.code, str(err)) from None

    async def _check_token(self, token: int, sender: str) -> None:
        """The fencing token is the live trainer lease's, and (signed pushes) its holder signed:
        tokens are no secret (every plan carries one), so they fence, never authenticate."""
        if token < self.highest_token:
            raise PushRejected("stale_token", f"fencing token {token} < highest seen {self.highest_token}")
        held = await self.store.holder(TRAINER_ROLE)
        if held is None or held.token != token:
            raise PushRejected("stale_token", f"fencing token {token} is not the live trainer lease")
        if self.verifier is not None and held.owner != sender:
            raise PushRejected(
                "unauthorized", f"{sender!r} signed, but the trainer lease is {held.owner!r}'s"
            )


async def start_server(
    servicer: WeightSyncServicer, host: str, port: int, token: str | None = None, tls: TlsFiles | None = None
) -> tuple[grpc.aio.Server, int]:
    """Starts the server; returns it and the bound port (port 0 picks a free one). With a `token`,
    every call must carry it as a bearer token (services/common/grpc_auth.py)."""
    server = grpc.aio.server(
        interceptors=[BearerTokenInterceptor(token)] if token else None,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    ws_grpc.add_WeightSyncServicer_to_server(servicer, server)
    creds = tls.grpc_server_credentials() if tls is not None else None
    addr = f"{host}:{port}"
    bound = server.add_secure_port(addr, creds) if creds is not None else server.add_insecure_port(addr)
    if bound == 0:
        raise SystemExit(f"cannot bind the WeightSync server to {host}:{port}")
    await server.start()
    return server, bound
