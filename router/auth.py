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
# NOTE: calls that change the cluster rather than use it; with admin keys (security.admin_api_keys_env) only those
# open them, so a leaked inference key cannot resize (or empty) the pools
ADMIN_METHODS = ("/pdcluster.v1.Inference/Scale",)
FORBIDDEN_MESSAGE = "this is an admin call: it needs an admin key (security.admin_api_keys_env), not an inference key"


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
    """Rejects calls to the Inference service without a valid key with UNAUTHENTICATED.

    `admin_keys` (may be empty: then `keys` open admin calls too) are the only keys that open ADMIN_METHODS; an
    inference key there gets PERMISSION_DENIED. An admin key also opens inference calls.
    """

    def __init__(self, keys: frozenset[str], admin_keys: frozenset[str] = frozenset()) -> None:
        self.keys = keys
        self.admin_keys = admin_keys

    def _refusal(self, method: str, header: str | None) -> tuple[grpc.StatusCode, str] | None:
        """Why a call is refused (status and message), or None when it may go through."""
        if not method.startswith(PROTECTED_PREFIXES):
            return None
        if method in ADMIN_METHODS and self.admin_keys:
            if bearer_ok(header, self.admin_keys):
                return None
            if self.keys and bearer_ok(header, self.keys):
                return grpc.StatusCode.PERMISSION_DENIED, FORBIDDEN_MESSAGE
            return grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE
        if not self.keys or bearer_ok(header, self.keys) or (self.admin_keys and bearer_ok(header, self.admin_keys)):
            return None
        return grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        header = _authorization(details.invocation_metadata)
        refusal = None if handler is None else self._refusal(details.method, header)
        if refusal is None:
            return handler
        code, message = refusal
        if handler.request_streaming and handler.response_streaming:  # reflection
            async def deny_bidi(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                await context.abort(code, message)
                yield  # pragma: no cover - makes this an async generator, as streaming handlers are

            return grpc.stream_stream_rpc_method_handler(deny_bidi, handler.request_deserializer,
                                                         handler.response_serializer)
        if handler.response_streaming:
            async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await context.abort(code, message)
                yield  # pragma: no cover - makes this an async generator, as streaming handlers are

            return grpc.unary_stream_rpc_method_handler(deny_stream, handler.request_deserializer,
                                                        handler.response_serializer)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
