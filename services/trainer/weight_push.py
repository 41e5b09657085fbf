"""Streams one packed weight version to every rollout engine over gRPC, concurrently, with retries.

The blob is packed and hashed once per version; each engine gets the same chunks, the first of which
carries the header (version, size, checksum, the trainer's fencing token). An engine that answers
`stale_version` for the very version we send already has it, which is as good as an ack.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from services.common.contracts import ws, ws_grpc
from services.common.grpc_auth import bearer_metadata
from services.common.logging import get_logger
from services.common.tls import TlsFiles, grpc_channel
from services.common.tracing import grpc_metadata
from services.common.weights import checksum, chunks, pack_state_dict

# Codes after which another attempt cannot help: we lost the lease, or the engine refuses the blob.
_FINAL_CODES = {"stale_token", "stale_version", "malformed", "too_large", "unauthenticated"}


@dataclass(frozen=True)
class PackedWeights:
    version: int
    blob: bytes
    checksum: str

    @property
    def size(self) -> int:
        return len(self.blob)


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


def pack(state_dict: dict[str, Any], version: int) -> PackedWeights:
    """Packs a state dict for the wire; tied parameters are sent once, under their first name.

    safetensors refuses aliased tensors, and like `save_pretrained` we drop the alias (e.g.
    `lm_head.weight` tied to `model.embed_tokens.weight`): receivers load with `strict=False` and
    keep their own tie.
    """
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    unique: dict[str, Any] = {}
    for name, t in state_dict.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        unique[name] = t
    blob = pack_state_dict(unique)
    return PackedWeights(version, blob, checksum(blob))


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
    ):
        self.sender_id = sender_id
        self.tls = tls
        self._auth = bearer_metadata(token)
        self.chunk_bytes = chunk_bytes
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.log = get_logger(component="weight_push")
        self._channels: dict[str, grpc.aio.Channel] = {}
        limit = max(8 << 20, chunk_bytes + (1 << 20))
        self._options = [
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ]

    def _stub(self, addr: str) -> ws_grpc.WeightSyncStub:
        ch = self._channels.get(addr)
        if ch is None:
            ch = grpc_channel(addr, self.tls, self._options)
            self._channels[addr] = ch
        return ws_grpc.WeightSyncStub(ch)

    async def push(
        self, weights: PackedWeights, fencing_token: int, addrs: Sequence[str]
    ) -> dict[str, PushResult]:
        """Pushes to all `addrs` at once; never raises for an engine's failure, reports it instead."""
        results = await asyncio.gather(*(self._push_one(addr, weights, fencing_token) for addr in addrs))
        return {r.addr: r for r in results}

    async def _push_one(self, addr: str, weights: PackedWeights, fencing_token: int) -> PushResult:
        header = ws.WeightHeader(
            version=weights.version,
            total_bytes=weights.size,
            num_chunks=max(1, -(-weights.size // self.chunk_bytes)),
            checksum=weights.checksum,
            fencing_token=fencing_token,
            sender_id=self.sender_id,
            format="safetensors",
        )
        start = time.perf_counter()
        refused = await self._refuses_token(addr)
        if refused:
            self.log.warning(
                "weights_push_failed", engine=addr, version=weights.version, code="unauthenticated"
            )
            return PushResult(addr, False, "unauthenticated", refused, 0, time.perf_counter() - start, 1)
        code, message = "unavailable", ""
        attempt = 0
        for attempt in range(1, self.retries + 2):
            try:
                ack = await self._stub(addr).PushWeights(
                    self._stream(header, weights.blob),
                    metadata=grpc_metadata() + self._auth,
                    timeout=self.timeout_s,
                )
                code, message = ack.code or ("ok" if ack.accepted else "internal"), ack.message
                if ack.accepted or (code == "stale_version" and ack.version == weights.version):
                    return PushResult(
                        addr, True, code, message, weights.size, time.perf_counter() - start, attempt
                    )
                if code in _FINAL_CODES:
                    break
            except grpc.aio.AioRpcError as err:
                message = f"{err.code().name}: {err.details()}"
                if err.code() == grpc.StatusCode.UNAUTHENTICATED:  # a wrong token stays wrong
                    code = "unauthenticated"
                    break
                code = "unavailable"
            self.log.warning(
                "weights_push_retry",
                engine=addr,
                version=weights.version,
                attempt=attempt,
                code=code,
                reason=message[:200],
            )
            if attempt <= self.retries:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
        self.log.warning(
            "weights_push_failed", engine=addr, version=weights.version, code=code, reason=message
        )
        return PushResult(addr, False, code, message, 0, time.perf_counter() - start, attempt)

    async def versions(self, addrs: Sequence[str]) -> dict[str, int]:
        """The weight version each engine says it serves (those that answered)."""

        async def one(addr: str) -> tuple[str, int | None]:
            try:
                info = await self._stub(addr).GetVersion(ws.VersionRequest(), metadata=self._auth, timeout=5)
            except grpc.aio.AioRpcError:
                return addr, None
            return addr, int(info.version)

        answers = await asyncio.gather(*(one(a) for a in addrs))
        return {a: v for a, v in answers if v is not None}

    async def _refuses_token(self, addr: str) -> str:
        """Asks the engine's version first: a wrong token is refused there, cleanly, where a push
        the server aborts mid-stream can surface as a transient INTERNAL error and be retried."""
        try:
            await self._stub(addr).GetVersion(ws.VersionRequest(), metadata=self._auth, timeout=10)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                return f"UNAUTHENTICATED: {err.details()}"
        return ""

    async def _stream(self, header: ws.WeightHeader, blob: bytes) -> AsyncIterator[ws.WeightChunk]:
        view = memoryview(blob)
        for i, part in enumerate(chunks(view, self.chunk_bytes)):  # type: ignore[arg-type]
            yield ws.WeightChunk(header=header if i == 0 else None, index=i, data=bytes(part))
        if not blob:
            yield ws.WeightChunk(header=header, index=0, data=b"")

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
