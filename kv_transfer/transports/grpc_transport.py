"""The `grpc` transport: the KV service every remote transport's control calls reach, and its own data path.

Receiver: `KVTransferService` serves `pdcluster.v1.KVTransfer` over a `KVReceiver`. Sender: `GrpcControl`
(grpc_control) makes the control calls; `GrpcKVSender` streams K and V as sealed chunks over `grpc_streams`
parallel Push calls, each on its own TCP connection (one Python gRPC stream tops out well below what the socket
can carry).

The data path is a pipeline: the sender's thread seals each chunk (CRC32C) and frames it (`wire.chunk_to_wire`,
the one copy of its bytes) while gRPC's threads put earlier ones on the wire; the receiver's gRPC core reads the
next chunk while a handler thread checks one (on a view of the message: no copy) and writes it into the reserved
blocks. KVChunk is framed by `wire` rather than by generated stubs: same wire names, no protobuf copy of the data.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import torch

from engine.errors import CapacityError, EngineError, InvalidRequestError, UnknownRequestError
from kv_transfer import payload, tls, wire
from kv_transfer.auth import CheckToken
from kv_transfer.messages import Chunk
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender, Layer
from kv_transfer.state import TransferError
from kv_transfer.transports.grpc_control import CHANNEL_OPTIONS, GrpcControl, channel, transfer_error
from kv_transfer.v1 import kv_transfer_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["KVTransfer"].full_name  # "pdcluster.v1.KVTransfer"
QUEUED_CHUNKS = 4  # sealed chunks waiting per stream: the sender's thread runs this far ahead of the wire


def status_of(err: Exception) -> grpc.StatusCode:
    """The one place engine/transfer errors map to gRPC status codes on the KV service."""
    if isinstance(err, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(err, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(err, UnknownRequestError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(err, TransferError):
        return grpc.StatusCode.DATA_LOSS if err.retryable else grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


class KVTransferService:
    """gRPC face of a KVReceiver: protobuf in, messages to the receiver, protobuf out."""

    def __init__(self, receiver: KVReceiver) -> None:
        self.receiver = receiver

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except EngineError as e:
            context.abort(status_of(e), str(e))

    def Prepare(self, request: pb.PrepareRequest, context: grpc.ServicerContext) -> pb.PrepareResponse:  # noqa: N802
        prepared = self._call(context, lambda: self.receiver.prepare(wire.prepare_from_proto(request)))
        left = context.time_remaining()
        if not context.is_active() or (left is not None and left <= 0):
            # NOTE: the call ended before its answer (the sender's deadline passed while this engine hung): gRPC
            # drops the answer, the sender never learns the block ids, so none of them can be written (nixl's fence)
            self.receiver.abandon(prepared.transfer_id, "the sender's handshake ended before its answer")
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the handshake was answered too late")
        return wire.prepared_to_proto(prepared)

    def KeepAlive(self, request: pb.KeepAliveRequest,  # noqa: N802
                  context: grpc.ServicerContext) -> pb.KeepAliveResponse:
        self._call(context, lambda: self.receiver.keep_alive(request.transfer_id))
        return pb.KeepAliveResponse()

    def Push(self, request_iterator: Iterator[tuple[Chunk, memoryview]],  # noqa: N802
             context: grpc.ServicerContext) -> pb.PushResponse:
        transfer_id, nbytes = "", 0
        try:
            for chunk, data in request_iterator:
                transfer_id = chunk.transfer_id
                self.receiver.on_chunk(chunk, data)
                nbytes += len(data)
        except EngineError as e:
            context.abort(status_of(e), str(e))
        except Exception as e:  # noqa: BLE001 - a stream cut by a dead or cancelled sender lands here
            if transfer_id:
                self.receiver.fail(transfer_id, f"sender stream broke: {type(e).__name__}", retryable=True)
            raise
        return pb.PushResponse(bytes_received=nbytes)

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitResponse:  # noqa: N802
        received = self._call(context, lambda: self.receiver.commit(wire.commit_from_proto(request)))
        return pb.CommitResponse(bytes_received=received)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext) -> pb.AbortResponse:  # noqa: N802
        self.receiver.abort(wire.abort_from_proto(request))
        return pb.AbortResponse()

    def Watch(self, request: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.WatchResponse]:  # noqa: N802
        """nixl: held open by a sender while it may write into this receiver's pool; its end lifts the fence of the
        transfers it prepared (the sender died, or gave the pair up)."""
        if self.receiver.on_watch is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nixl is not enabled on this receiver")
            return
        ended = threading.Event()
        if not context.add_callback(ended.set):
            return  # NOTE: the call already ended
        release = self.receiver.on_watch(request.agent, context.peer())
        try:
            yield pb.WatchResponse()
            ended.wait()  # NOTE: one server thread per sender process, for the life of the pair
        finally:
            release()

    def handler(self) -> grpc.GenericRpcHandler:
        """The service's methods under their wire names; Push reads KVChunks with `wire.chunk_from_wire`."""
        def unary(fn: Callable[..., Any], req: Any, resp: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(fn, req.FromString, resp.SerializeToString)

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Prepare": unary(self.Prepare, pb.PrepareRequest, pb.PrepareResponse),
            "KeepAlive": unary(self.KeepAlive, pb.KeepAliveRequest, pb.KeepAliveResponse),
            "Push": grpc.stream_unary_rpc_method_handler(self.Push, wire.chunk_from_wire,
                                                         pb.PushResponse.SerializeToString),
            "Commit": unary(self.Commit, pb.CommitRequest, pb.CommitResponse),
            "Abort": unary(self.Abort, pb.AbortRequest, pb.AbortResponse),
            "Watch": grpc.unary_stream_rpc_method_handler(self.Watch, pb.WatchRequest.FromString,
                                                          pb.WatchResponse.SerializeToString),
        })


def serve(receiver: KVReceiver, address: str = "127.0.0.1:0", max_workers: int = 16,
          cluster_token: str = "", kv_tls: tls.KVTls | None = None) -> tuple[grpc.Server, int]:
    """Start the KV service (callers must present `cluster_token` if one is set, and a client certificate with
    `kv_tls`); returns the server and its port."""
    # NOTE: with TLS, the caller's certificate must also be issued for the cluster's name (kv_transfer/tls.py)
    checks = [CheckToken(cluster_token)] if cluster_token else []
    checks += [tls.CheckPeerName(kv_tls.server_name)] if kv_tls is not None else []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers, thread_name_prefix="kv-grpc"),
                         options=CHANNEL_OPTIONS, interceptors=checks or None)
    server.add_generic_rpc_handlers((KVTransferService(receiver).handler(),))
    port = (server.add_secure_port(address, tls.server_credentials(kv_tls)) if kv_tls is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"cannot bind the KV transfer service to {address}")
    server.start()
    return server, port


class GrpcKVSender(KVSender):
    """Streams each layer's K and V in sealed chunks over parallel Push calls."""

    transport = "grpc"
    control: GrpcControl
    _calls: tuple[grpc.Future, ...] = ()  # the Push calls in flight, cancelled on abort

    def _send_layers(self, layers: Iterator[Layer]) -> None:
        # NOTE: called once the first layer is ready, not at the handshake: the receiver's server gives each open
        # stream a thread, and streams held open while prompts queue for prefill would starve it
        if self.state.finished:
            return
        n_streams = self.config.grpc_streams
        queues: list[queue.Queue[bytes | None]] = [queue.Queue(QUEUED_CHUNKS) for _ in range(n_streams)]
        calls = [channel(self.control.address, i, self.control.cluster_token, self.control.tls).stream_unary(
            f"/{SERVICE}/Push", response_deserializer=pb.PushResponse.FromString).future(
            self._messages(q), timeout=self.remaining()) for i, q in enumerate(queues)]
        self._calls = tuple(calls)
        try:
            self._feed(layers, itertools.cycle(zip(queues, calls)))
        finally:
            for q, call in zip(queues, calls):
                self._put(q, call, None)
        for call in calls:
            try:
                call.result(timeout=self.remaining())
            except grpc.RpcError as e:
                for c in calls:
                    c.cancel()
                raise transfer_error(e, self.request_id, f"push to {self.control.address}") from None
            except futures.TimeoutError:
                for c in calls:
                    c.cancel()
                raise TransferError("deadline passed while pushing", self.request_id, retryable=True) from None

    def _feed(self, layers: Iterator[Layer], streams: Iterator[tuple[queue.Queue[bytes | None], grpc.Future]]) -> None:
        """Seal and frame every chunk of every layer, dealing them round-robin to the streams."""
        for layer in layers:
            for which, t in ((0, layer.k), (1, layer.v)):
                for first, piece in self._pieces(t):
                    chunk = payload.seal(self.transfer_id, layer.index, which, first, piece)
                    if not self._put(*next(streams), self._encode(chunk, payload.as_bytes(piece))):
                        return  # NOTE: a stream ended early (it failed): its status says why
                    self.bytes_sent += piece.numel() * piece.element_size()

    def _pieces(self, t: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """`t` ([n, *block_shape]) cut into even chunks of at most `chunk_bytes` (views, no copy)."""
        t = t.contiguous().cpu()  # NOTE: a GPU pool's layer leaves through the host (gRPC sends bytes)
        n = t.shape[0]
        per_chunk = max(1, self.config.chunk_bytes // payload.block_nbytes(self.layout))
        step = -(-n // -(-n // per_chunk)) if n else 1
        for a in range(0, n, step):
            yield a, t[a : a + step]

    def _encode(self, chunk: Chunk, data: memoryview) -> bytes:
        """One KVChunk as it goes on the wire."""
        return wire.chunk_to_wire(chunk, data)

    def _put(self, q: queue.Queue[bytes | None], call: grpc.Future, msg: bytes | None) -> bool:
        """Hand `msg` to a stream; False if the stream ended or the transfer finished meanwhile."""
        while not (call.done() or self.state.finished):
            try:
                q.put(msg, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _messages(self, q: queue.Queue[bytes | None]) -> Iterator[bytes]:
        """A Push call's request stream (gRPC's sending thread pulls it)."""
        while not self.state.finished:
            try:
                msg = q.get(timeout=0.2)
            except queue.Empty:
                continue  # NOTE: wake up now and then so an aborted transfer ends this thread
            if msg is None:
                return
            yield msg

    def abort(self, reason: str) -> None:
        for call in self._calls:
            call.cancel()
        super().abort(reason)
