"""API keys on the router's fronts: `authorization: Bearer <key>` (gRPC metadata or HTTP header), never logged."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

PROTECTED_PREFIX = "/pdcluster.v1.Inference/"  # health and reflection stay open, as load balancers expect
UNAUTHENTICATED_MESSAGE = "missing or invalid API key: send the header 'authorization: Bearer <key>'"


def bearer_ok(header: str | None, keys: frozenset[str]) -> bool:
    """Whether an Authorization value carries one of `keys` (constant-time; no keys means no check)."""
    if not keys:
        return True
    if not header or not header.startswith("Bearer "):
        return False
    sent = header.removeprefix("Bearer ").strip().encode()
    # NOTE: compare against every key so the time taken does not tell which one was close
    return any([hmac.compare_digest(sent, k.encode()) for k in keys])


def _authorization(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value if isinstance(value, str) else value.decode()
    return None


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls to the Inference service without a valid key with UNAUTHENTICATED."""

    def __init__(self, keys: frozenset[str]) -> None:
        self.keys = keys

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if (handler is None or not details.method.startswith(PROTECTED_PREFIX)
                or bearer_ok(_authorization(details.invocation_metadata), self.keys)):
            return handler
        if handler.response_streaming:
            async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
                yield  # pragma: no cover - makes this an async generator, as streaming handlers are

            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                        handler.response_serializer)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
