"""WeightSync gRPC server: the trainer streams a new weight version, the engine checks and applies it.

A push is refused, and changes nothing, unless all of this holds: the first chunk carries a
well-formed header (format "safetensors"); the sender's fencing token is the live trainer lease's
and not below the highest token seen (checked when the header arrives and again before applying,
since the lease may be lost mid-stream); the version is newer than the engine's; and the received
bytes match the header's chunk count, total size and sha256. The header may ride on the first data
chunk or come alone; `num_chunks` may count either the data chunks or all messages.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import grpc

from services.common.contracts import ws, ws_grpc
from services.common.grpc_auth import BearerTokenInterceptor
from services.common.logging import get_logger
from services.common.membership import TRAINER_ROLE
from services.common.ownership import OwnershipStore
from services.common.tls import TlsFiles
from services.common.tracing import context_from_grpc, tracer
from services.common.weights import read_header, unpack_state_dict
from services.rollout_engine.engine import Engine

MAX_MESSAGE_BYTES = 64 << 20


class PushRejected(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class WeightSyncServicer(ws_grpc.WeightSyncServicer):
    def __init__(
        self,
        engine: Engine,
        store: OwnershipStore,
        engine_id: str,
        max_push_bytes: int = 64 << 30,
        keep_tensors: bool = True,
    ):
        """`keep_tensors=False` (emulated engines) checks a push's safetensors header and hands the
        engine names and shapes only, so the engine never imports torch."""
        self.engine = engine
        self.decode = unpack_state_dict if keep_tensors else read_header
        self.max_push_bytes = max_push_bytes
        self.store = store
        self.engine_id = engine_id
        self.highest_token = 0
        self.log = get_logger(component="weight_sync")
        self._apply = asyncio.Lock()

    async def GetVersion(self, request: ws.VersionRequest, context: Any) -> ws.VersionInfo:
        return ws.VersionInfo(
            engine_id=self.engine_id, version=self.engine.version, checksum=self.engine.checksum
        )

    async def PushWeights(self, request_iterator: Any, context: Any) -> ws.PushAck:
        ctx = context_from_grpc(context.invocation_metadata())
        with tracer().start_as_current_span("weights.apply", context=ctx) as span:
            span.set_attribute("libra.engine_id", self.engine_id)
            started = time.monotonic()
            try:
                header = await self._receive_and_apply(request_iterator, span)
            except PushRejected as err:
                span.set_attribute("libra.push_code", err.code)
                self.log.warning("weights_rejected", code=err.code, reason=str(err))
                return ws.PushAck(
                    accepted=False, version=self.engine.version, code=err.code, message=str(err)
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
                sender=header.sender_id,
                apply_s=round(apply_s, 4),
            )
            return ws.PushAck(accepted=True, version=header.version, code="ok", apply_s=apply_s)

    async def _receive_and_apply(self, request_iterator: Any, span: Any) -> ws.WeightHeader:
        header: ws.WeightHeader | None = None
        digest = hashlib.sha256()
        parts: list[bytes] = []
        received = messages = data_chunks = 0
        async for chunk in request_iterator:
            if header is None:
                if not chunk.HasField("header"):
                    raise PushRejected("malformed", "first chunk carries no header")
                header = chunk.header
                self._check_header(header)
                await self._check_token(header.fencing_token)
                if header.version <= self.engine.version:
                    raise PushRejected(
                        "stale_version", f"version {header.version} <= current {self.engine.version}"
                    )
                span.set_attribute("libra.policy_version", header.version)
            elif chunk.HasField("header"):
                raise PushRejected("malformed", f"second header at message {messages}")
            messages += 1
            if chunk.data:
                data_chunks += 1
                received += len(chunk.data)
                if received > header.total_bytes:
                    raise PushRejected(
                        "checksum_mismatch", f"more than total_bytes={header.total_bytes} received"
                    )
                digest.update(chunk.data)
                parts.append(chunk.data)
        if header is None:
            raise PushRejected("malformed", "empty stream")
        if header.num_chunks not in (data_chunks, messages):
            raise PushRejected(
                "checksum_mismatch", f"got {data_chunks} chunks, header says {header.num_chunks}"
            )
        if received != header.total_bytes:
            raise PushRejected("checksum_mismatch", f"got {received} bytes, header says {header.total_bytes}")
        if digest.hexdigest() != header.checksum.lower():
            raise PushRejected("checksum_mismatch", "sha256 of received data differs from header")
        blob = b"".join(parts)
        parts.clear()
        try:
            state_dict = await asyncio.to_thread(self.decode, blob)
        except Exception as err:
            raise PushRejected("malformed", f"not a safetensors blob: {err}") from None
        async with self._apply:
            await self._check_token(header.fencing_token)
            try:
                swapped = await self.engine.swap_weights(state_dict, header.version, header.checksum.lower())
            except ValueError as err:
                raise PushRejected("malformed", str(err)) from None
            if not swapped:
                raise PushRejected(
                    "stale_version", f"version {header.version} <= current {self.engine.version}"
                )
            self.highest_token = max(self.highest_token, header.fencing_token)
        return header

    def _check_header(self, h: ws.WeightHeader) -> None:
        if h.format not in ("", "safetensors"):
            raise PushRejected("malformed", f"unsupported format {h.format!r}")
        if h.version <= 0 or h.num_chunks <= 0 or h.total_bytes <= 0:
            raise PushRejected("malformed", "version, num_chunks and total_bytes must be positive")
        if h.total_bytes > self.max_push_bytes:
            raise PushRejected(
                "too_large", f"total_bytes={h.total_bytes} > max_push_bytes={self.max_push_bytes}"
            )
        if len(h.checksum) != 64 or any(c not in "0123456789abcdefABCDEF" for c in h.checksum):
            raise PushRejected("malformed", "checksum must be a sha256 hex digest")

    async def _check_token(self, token: int) -> None:
        if token < self.highest_token:
            raise PushRejected("stale_token", f"fencing token {token} < highest seen {self.highest_token}")
        if not await self.store.is_current(TRAINER_ROLE, token):
            raise PushRejected("stale_token", f"fencing token {token} is not the live trainer lease")


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
