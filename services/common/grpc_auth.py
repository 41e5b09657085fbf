"""Bearer-token authentication for Libra's gRPC services.

The token is a stack credential, distinct from the trainer's fencing token: the fencing token says
*which* trainer may push (and travels in every plan), the bearer token says the caller belongs to
the stack at all. A call without the right token is refused with UNAUTHENTICATED before any
handler runs, so an unauthenticated push never gets a byte buffered.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from services.common.logging import get_logger

_HEADER = "authorization"


def bearer_metadata(token: str | None) -> list[tuple[str, str]]:
    return [(_HEADER, f"Bearer {token}")] if token else []


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()
        self.refused = 0
        self.log = get_logger(component="grpc_auth")

    def _authorised(self, metadata: Any) -> bool:
        for key, value in metadata or ():
            if key == _HEADER:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._expected)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or self._authorised(details.invocation_metadata):
            return handler
        self.refused += 1
        self.log.warning("grpc_unauthenticated", method=details.method, refused=self.refused)
        return _refusal(handler)


def _refusal(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that aborts at once."""

    async def abort(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)
