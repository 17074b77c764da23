"""The gRPC control plane every remote transport uses: cached channels to a receiver's KV service, and
`GrpcControl`'s handshake, commit, abort and keep-alive calls (the data paths are in grpc_transport, nixl_*,
torch_transport)."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

from kv_transfer import tls, wire
from kv_transfer.auth import add_token
from kv_transfer.messages import Abort, Commit, Prepared, PrepareRequest
from kv_transfer.sender import Control
from kv_transfer.state import TransferError
from kv_transfer.v1 import kv_transfer_pb2 as pb
from kv_transfer.v1 import kv_transfer_pb2_grpc as pb_grpc

MAX_MESSAGE = 80 << 20
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
                   ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 1000)]
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}


_channels: dict[tuple[str, int, str, tls.KVTls | None], grpc.Channel] = {}
_channels_lock = threading.Lock()


def channel(address: str, index: int = 0, cluster_token: str = "", kv_tls: tls.KVTls | None = None) -> grpc.Channel:
    """A cached channel to `address` presenting `cluster_token` (over mutual TLS with `kv_tls`); distinct
    `index`es get distinct TCP connections."""
    key = (address, index, cluster_token, kv_tls)
    with _channels_lock:
        ch = _channels.get(key)
        if ch is None:
            opts = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1), ("pdcluster.connection", index)]
            if kv_tls is None:
                ch = grpc.insecure_channel(address, options=opts)
            else:
                ch = grpc.secure_channel(address, tls.channel_credentials(kv_tls),
                                         options=[*opts, *tls.channel_options(kv_tls)])
            if cluster_token:
                ch = grpc.intercept_channel(ch, add_token(cluster_token))
            _channels[key] = ch
        return ch


def forget_channels(address: str) -> None:
    """Drop the cached channels to `address`: the next call dials afresh. Calls in flight keep theirs."""
    # NOTE: a channel whose server went away waits out its reconnect backoff and fails calls fast meanwhile, even
    # once a new server listens at the same port (a restarted worker, an OS that hands the port out again)
    with _channels_lock:
        for key in [k for k in _channels if k[0] == address]:
            del _channels[key]


def never_sent(err: grpc.RpcError) -> bool:
    """The call failed before any byte left: the channel had no connection ("failed to connect to all addresses")."""
    return (err.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            and "failed to connect" in (err.details() or ""))  # type: ignore[attr-defined]


def transfer_error(err: grpc.RpcError, request_id: str, what: str) -> TransferError:
    code = err.code()  # type: ignore[attr-defined]
    return TransferError(f"{what}: {code.name}: {err.details()}", request_id,  # type: ignore[attr-defined]
                         retryable=code in RETRYABLE)


class GrpcControl(Control):
    """Control calls to a receiver's KV service at `address` (host:port)."""

    def __init__(self, address: str, cluster_token: str = "", kv_tls: tls.KVTls | None = None) -> None:
        self.address = address
        self.cluster_token = cluster_token
        self.tls = kv_tls
        self.stub = pb_grpc.KVTransferStub(channel(address, 0, cluster_token, kv_tls))

    def _call(self, method: str, msg: Any, timeout: float, what: str, request_id: str = "") -> Any:
        """One unary call. One that never reached the receiver (no connection) is tried once more on a fresh
        channel: the cached one may be waiting out its reconnect backoff from a server that went away."""
        deadline = time.monotonic() + timeout
        try:
            return getattr(self.stub, method)(msg, timeout=timeout)
        except grpc.RpcError as e:
            err = e
        left = deadline - time.monotonic()
        if never_sent(err) and left > 0:  # NOTE: only then is a retry safe: nothing was reserved or committed
            forget_channels(self.address)
            self.stub = pb_grpc.KVTransferStub(channel(self.address, 0, self.cluster_token, self.tls))
            try:
                return getattr(self.stub, method)(msg, timeout=left)
            except grpc.RpcError as e:
                err = e
        raise transfer_error(err, request_id, f"{what} at {self.address}") from None

    def prepare(self, req: PrepareRequest, timeout: float) -> Prepared:
        return wire.prepared_from_proto(self._call("Prepare", wire.prepare_to_proto(req), timeout, "prepare",
                                                   req.request_id))

    def commit(self, req: Commit, timeout: float) -> int:
        return int(self._call("Commit", wire.commit_to_proto(req), timeout, "commit").bytes_received)

    def abort(self, req: Abort, timeout: float) -> None:
        self._call("Abort", wire.abort_to_proto(req), timeout, "abort")

    def keep_alive(self, transfer_id: str, timeout: float) -> None:
        self._call("KeepAlive", pb.KeepAliveRequest(transfer_id=transfer_id), timeout, "keep-alive")


