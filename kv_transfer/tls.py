"""Mutual TLS on the KV gRPC plane: each member presents the cluster's certificate and checks its peer's.

NOTE: with `TransferConfig.tls` set, a receiver's KV port speaks only TLS and requires a client certificate that
chains to `root_certs`; a sender checks the receiver's certificate the same way. Every member presents the same
certificate (the cluster's, `security.tls_cert_file`), so the name a sender checks is the one in that certificate
(`server_name`), not the receiver's address: decode workers are reached by IP and the certificate may be issued for
the router's public name. Possession of a certificate the cluster's CA signed is what admits a peer; the cluster
token is still checked on top. The torch transport's TCPStore and gloo/NCCL ports are outside TLS (see
kv_transfer/README.md).
NOTE: the name is checked both ways: a sender checks the receiver's certificate against `server_name` (gRPC's
host-name check), and a receiver checks the sender's (`CheckPeerName`), so a certificate the CA issued to something
else (another service, a user) does not admit its holder to the KV plane.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc


@dataclass(frozen=True)
class KVTls:
    """This member's certificate chain and key, and the CA certificates a peer's must chain to (all PEM)."""

    cert_chain: bytes = field(repr=False)
    private_key: bytes = field(repr=False)
    root_certs: bytes = field(repr=False)
    server_name: str = "localhost"  # a name the certificate is issued for: what senders check receivers against


def server_credentials(tls: KVTls) -> grpc.ServerCredentials:
    """TLS for a receiver's KV port; a caller without a certificate the CA signed fails the handshake."""
    return grpc.ssl_server_credentials([(tls.private_key, tls.cert_chain)], root_certificates=tls.root_certs,
                                       require_client_auth=True)


def channel_credentials(tls: KVTls) -> grpc.ChannelCredentials:
    """TLS for a sender's channel: present this member's certificate, accept only receivers the CA signed."""
    return grpc.ssl_channel_credentials(tls.root_certs, tls.private_key, tls.cert_chain)


def channel_options(tls: KVTls) -> list[tuple[str, Any]]:
    """The receiver's certificate is checked against the cluster certificate's name, not the address dialled."""
    return [("grpc.ssl_target_name_override", tls.server_name)]


def peer_names(auth_context: dict[str, list[bytes]]) -> set[str]:
    """The DNS names and common name of the peer's certificate in a gRPC auth context."""
    keys = ("x509_subject_alternative_name", "x509_common_name")
    return {v.decode(errors="replace") for k in keys for v in auth_context.get(k, ())}


class CheckPeerName(grpc.ServerInterceptor):
    """Receiver side: a caller whose certificate is not issued for `name` gets PERMISSION_DENIED."""

    def __init__(self, name: str) -> None:
        self.name = name

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        name = self.name

        def checked(behaviour: Callable[..., Any]) -> Callable[..., Any]:
            def call(request: Any, context: grpc.ServicerContext) -> Any:
                names = peer_names(context.auth_context())
                if name not in names:
                    context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                  f"this KV endpoint accepts only certificates issued for {name!r}")
                return behaviour(request, context)
            return call

        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(checked(handler.unary_unary), handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(checked(handler.stream_unary), handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(checked(handler.unary_stream), handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(checked(handler.stream_stream), handler.request_deserializer,
                                                     handler.response_serializer)
