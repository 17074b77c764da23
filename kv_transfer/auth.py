"""Only cluster members may use a KV endpoint: every call carries the cluster's shared token, checked first.

NOTE: the token travels as gRPC metadata on every KV call (control and Push streams); a receiver started with a
token rejects calls without it as UNAUTHENTICATED before any block is reserved. The torch transport's pair groups
are set up through the same checked Prepare call, but its TCPStore and gloo/NCCL ports themselves are not checked
(nor encrypted, also with `TransferConfig.tls`): keep them on a private network.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

TOKEN_KEY = "x-pdcluster-cluster-token"


class AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor):
    """Client side: put fixed metadata (the cluster token, an API key) on every call of a channel."""

    def __init__(self, *metadata: tuple[str, str]) -> None:
        self._metadata = metadata

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


def add_token(token: str) -> AddMetadata:
    return AddMetadata((TOKEN_KEY, token))


class CheckToken(grpc.ServerInterceptor):
    """Server side: calls without the cluster token get UNAUTHENTICATED (the token is never logged)."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        sent = dict(details.invocation_metadata or ()).get(TOKEN_KEY, "")
        if hmac.compare_digest(str(sent).encode(), self._token):
            return continuation(details)
        handler = continuation(details)
        message = "this KV endpoint accepts only members of its cluster (missing or wrong cluster token)"

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        if handler is not None and handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny, handler.request_deserializer, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer if handler else None,
                                                   handler.response_serializer if handler else None)
