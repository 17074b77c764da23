"""API keys on the router's fronts: `authorization: Bearer <key>` (gRPC metadata or HTTP header), never logged."""

from __future__ import annotations

import hmac
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

# NOTE: health stays open, as load balancers expect; reflection needs the key too (it maps the whole API)
PROTECTED_PREFIXES = ("/pdcluster.v1.Inference/", "/grpc.reflection.v1alpha.ServerReflection/",
                      "/grpc.reflection.v1.ServerReflection/")
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


class ExposureError(ValueError):
    """A front that would serve other machines without API keys (names the setting to change)."""


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only ('localhost', 127.0.0.0/8, ::1); '' and 0.0.0.0 do not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: loopback only if every address it resolves to is
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def check_exposure(host: str, keys: frozenset[str], allow_unauthenticated: bool, field: str) -> None:
    """Refuse (ExposureError) to bind a non-loopback `host` without API keys unless explicitly allowed.

    NOTE: as Redis's protected mode: without keys, anyone who reaches the port can run inference and read
    GetClusterStatus (every decode worker's KV address); a deployment that wants that says so in its YAML.
    """
    if keys or allow_unauthenticated or is_loopback(host):
        return
    raise ExposureError(f"{field}: {host!r} serves other machines, but no API keys are set: set "
                        "security.api_keys_env (clients send 'authorization: Bearer <key>'), bind 127.0.0.1, or set "
                        "security.allow_unauthenticated: true to serve them without keys")


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
        if (handler is None or not details.method.startswith(PROTECTED_PREFIXES)
                or bearer_ok(_authorization(details.invocation_metadata), self.keys)):
            return handler
        if handler.request_streaming and handler.response_streaming:  # reflection
            async def deny_bidi(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
                yield  # pragma: no cover - makes this an async generator, as streaming handlers are

            return grpc.stream_stream_rpc_method_handler(deny_bidi, handler.request_deserializer,
                                                         handler.response_serializer)
        if handler.response_streaming:
            async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
                yield  # pragma: no cover - makes this an async generator, as streaming handlers are

            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                        handler.response_serializer)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
