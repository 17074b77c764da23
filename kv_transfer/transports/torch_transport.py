"""The `torch` transport: torch.distributed point-to-point, `gloo` on CPU and `nccl` on GPU, one code path.

Each (sender, receiver) pair gets its own two-rank process group, made on demand: the receiver hosts a TCPStore
and names a group key in its Prepare answer; a new key means a new group. A broken pair (a dead peer, a stream
out of step) is retired and the next transfer makes a fresh group, so a dead peer never poisons the others. Control
stays on gRPC.

On its turn a transfer opens with an intro [1 = data follows, 0 = skipped] (a transfer aborted before its first
layer sends only that). Then per layer the sender sends K, then V, then a header [layer, first_block, num_blocks,
CRC32C of K, CRC32C of V] (the proto's header comment): K and V go on the wire first and their checksums are
computed while they travel. A transfer aborted part-way (or failed on the receiver: abort, checksum) still runs to
its last layer, the sender filling the missing layers with zeros under first_block = -1 and the receiver dropping
what it gets, so the pair stays in step and the transfers queued behind it go on.

Up to `IN_FLIGHT_LAYERS` layers are in flight: the sender waits for a layer's sends only once that many newer ones
are queued, and the receiver keeps that many layers' receives posted (into a ring of buffers) while it checks and
writes the oldest into the reserved blocks. Transfers of one pair run one after another in
the order of their tags, on both sides (NCCL ignores tags; both sides post in the same order). With
`device="cuda"` the layers are staged from the CPU KV pool to the GPU, sent with NCCL, and staged back; when the
engines' KV pools are on the GPU themselves, layers go from the sender's pool (a device gather) over NCCL into the
receiver's pool with no host copy, checked by a word sum computed on the device (`payload.device_sum`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.errors import EngineError
from kv_transfer import payload
from kv_transfer.inbound import Inbound
from kv_transfer.messages import Chunk, Prepared, PrepareRequest, TorchRendezvous
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender, Layer
from kv_transfer.state import TransferConfig, TransferError, TransferState
from kv_transfer.transports.liveness import PeerWatch
from kv_transfer.transports.torch_pairs import (
    QUEUED_WAIT_S,
    RECEIVER,
    SENDER,
    Pair,
    address_towards,
    make_group,
    retire,
    wait_all,
)

log = logging.getLogger(__name__)

# NOTE: 4 layers of a 2k-token prompt are ~12 MB: enough to keep the socket busy while one is checked and written
IN_FLIGHT_LAYERS = 4
HEADER = 5  # int64 [layer, first_block, num_blocks, crc32c of K, crc32c of V]
FILLER = -1  # header first_block of a layer the sender did not send (the transfer stopped): dropped


class TorchEndpoint:
    """Receiver side: hosts the TCPStore, keeps a pair group per sender, receives each transfer's layers."""

    def __init__(self, receiver: KVReceiver, host: str = "127.0.0.1", backend: str = "gloo",
                 device: str = "cpu", group_timeout_s: float = 30.0) -> None:
        self.receiver, self.host, self.backend, self.device = receiver, host, backend, device
        self.group_timeout_s = group_timeout_s
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=group_timeout_s))
        self.port = self.store.port
        self._pairs: dict[str, Pair] = {}
        self._pair_of: dict[str, Pair] = {}  # transfer id → its pair
        self._lock = threading.Lock()
        receiver.on_prepare, receiver.transport = self.prepare, "torch"

    def prepare(self, req: PrepareRequest, t: Inbound) -> TorchRendezvous:
        with self._lock:
            pair = self._pairs.get(req.sender_id)
            if pair is None or pair.broken:
                pair = self._pairs[req.sender_id] = Pair(f"{req.sender_id}/{uuid.uuid4().hex[:12]}")
                threading.Thread(target=self._make, args=(pair,), daemon=True, name="kv-torch-group").start()
            tag = next(pair.tags)
            self._pair_of[t.transfer_id] = pair
        threading.Thread(target=self._receive, args=(pair, tag, t), daemon=True,
                         name=f"kv-torch-recv-{t.request_id}").start()
        return TorchRendezvous(self.host, self.port, pair.key, self.backend, tag, self.device)

    def _retire(self, pair: Pair) -> None:
        retire(pair, self._pairs, self._lock)

    def _make(self, pair: Pair) -> None:
        try:
            pair.group.set_result(make_group(self.backend, self.store, pair.key, RECEIVER, self.group_timeout_s,
                                             self.host, self.device))
        except Exception as e:  # noqa: BLE001 - reported to every transfer waiting on this pair
            pair.breaks()
            pair.group.set_exception(e)

    def _receive(self, pair: Pair, tag: int, t: Inbound) -> None:
        self.receiver.set_receiving(t, True)
        try:
            pair.wait_turn(tag)
            group = pair.wait_group(self.group_timeout_s + 5)
            intro = torch.empty(1, dtype=torch.int64, device=self.device)
            wait_all([group.recv([intro], SENDER, tag)], time.monotonic() + QUEUED_WAIT_S)
            if intro.item():
                self._receive_layers(group, tag, t)
            pair.end_turn(tag)
        except Exception as e:  # noqa: BLE001 - the pair is out of step or its peer gone: retire it
            if t.state is TransferState.TRANSFERRING:
                self.receiver.fail(t.transfer_id, f"torch receive failed: {e}", retryable=True)
            self._retire(pair)
        finally:
            self.receiver.set_receiving(t, False)
            with self._lock:
                self._pair_of.pop(t.transfer_id, None)

    def _receive_layers(self, group: Any, tag: int, t: Inbound) -> None:
        """Every layer of `t`, checked and written while `t` is live, dropped once it failed (the pair keeps step)."""
        layout, n = self.receiver.layout, t.num_blocks
        depth = min(IN_FLIGHT_LAYERS, layout.num_layers)
        ring = [(torch.empty((2, n, *layout.block_shape), dtype=layout.torch_dtype, device=self.device),
                 torch.empty(HEADER, dtype=torch.int64, device=self.device)) for _ in range(depth)]

        def post(layer: int) -> list[Any]:  # the receives of one layer into its ring slot
            buf, header = ring[layer % depth]
            return [group.recv([x], SENDER, tag) for x in (buf[0], buf[1], header)]

        posted = deque(post(layer) for layer in range(depth))
        for layer in range(layout.num_layers):
            # NOTE: the next layer is due within a deadline, also when this transfer failed meanwhile
            wait_all(posted.popleft(), time.monotonic() + t.lifetime)
            buf, header = ring[layer % depth]
            got, first, count, crc_k, crc_v = header.tolist()
            if (got, count) != (layer, n) or first not in (0, FILLER):
                raise TransferError(f"expected layer {layer} blocks [0, {n}), got layer {got} [{first}, "
                                    f"{first + count})")
            if first == FILLER:
                self.receiver.fail(t.transfer_id, "the sender stopped the transfer")
            elif t.state is TransferState.TRANSFERRING:
                # NOTE: checked on the wire buffer (the sender checked what it put on the wire), then written by the
                # engine from wherever it is: a GPU pool straight from the GPU buffer, a CPU pool staged back
                kv = buf
                try:
                    self.receiver.on_tensor(Chunk(t.transfer_id, layer, 0, 0, n, crc_k), kv[0])
                    self.receiver.on_tensor(Chunk(t.transfer_id, layer, 1, 0, n, crc_v), kv[1])
                except EngineError:
                    pass  # NOTE: the receiver failed the transfer (bad checksum, aborted): drain the rest
            if layer + depth < layout.num_layers:  # NOTE: the slot is free again only now
                posted.append(post(layer + depth))


_pairs: dict[tuple[str, str], Pair] = {}  # sender side: (receiver address, group key) → pair
_pairs_lock = threading.Lock()


class TorchKVSender(KVSender):
    """Sends each layer with torch.distributed send over the pair group named in the handshake."""

    transport = "torch"

    def _on_prepared(self, resp: Prepared) -> None:
        rv = resp.torch
        if rv is None:
            raise TransferError("the receiver's answer names no torch rendezvous", self.request_id)
        self._tag, self._device = rv.tag, rv.device
        with _pairs_lock:
            pair = _pairs.get((rv.host, rv.group_key))
            if pair is None:
                pair = _pairs[(rv.host, rv.group_key)] = Pair(rv.group_key)
                threading.Thread(target=self._make, args=(pair, rv), daemon=True, name="kv-torch-group").start()
        self._pair = pair

    def _make(self, pair: Pair, rv: TorchRendezvous) -> None:
        try:
            store = dist.TCPStore(rv.host, rv.port, is_master=False, timeout=timedelta(seconds=self.remaining()))
            pair.group.set_result(make_group(rv.backend, store, rv.group_key, SENDER, self.remaining(),
                                             address_towards(rv.host), rv.device))
        except Exception as e:  # noqa: BLE001 - reported to every transfer waiting on this pair
            pair.breaks()
            pair.group.set_exception(e)

    def _watch(self) -> PeerWatch:
        # NOTE: gloo may wait on a dead receiver until its own timeout: its control plane is watched meanwhile;
        # once the commit is asked, the receiver may be DONE and say it no longer holds the transfer
        return PeerWatch(self.control.keep_alive, self.transfer_id, self._lost, answers=lambda: not self._committing)

    def _lost(self, err: TransferError, unreachable: bool) -> None:
        """The receiver dropped the transfer (the pair keeps step: the rest goes as fillers) or is gone (the pair is
        retired: transfers waiting for its group or their turn fail now, the next one makes a fresh group)."""
        self.abort_after(TransferError(err.reason, self.request_id, retryable=err.retryable))
        if unreachable:
            self._retire(self._pair)

    def _send_layers(self, layers: Iterator[Layer]) -> None:
        pair, tag = self._pair, self._tag
        try:
            pair.wait_turn(tag)
            group = pair.wait_group()
            go = not self.state.finished
            intro = torch.tensor([int(go)], dtype=torch.int64).to(self._device)
            in_flight: deque[tuple[list[Any], tuple[torch.Tensor, ...]]] = deque()  # works, and what they read
            in_flight.append(([group.send([intro], RECEIVER, tag)], (intro,)))
            sent = 0
            if go:
                try:
                    for layer in layers:
                        self._send(group, layer, in_flight)
                        sent += 1
                except TransferError as e:  # NOTE: the deadline passed between two layers: stop, keep in step
                    self.abort_after(e)
                self._fill(group, sent, in_flight)
            while in_flight:
                wait_all(in_flight.popleft()[0], self._wait_until())
            pair.end_turn(tag)
        except TransferError:
            self._retire(pair)
            raise
        except Exception as e:
            self._retire(pair)
            raise TransferError(f"torch send failed: {e}", self.request_id, retryable=True) from None

    def _send(self, group: Any, layer: Layer, in_flight: deque[tuple[list[Any], tuple[torch.Tensor, ...]]],
              first: int = 0) -> None:
        """K and V of one layer, then its header; waits for the oldest layer beyond IN_FLIGHT_LAYERS."""
        k, v = layer.k.contiguous(), layer.v.contiguous()
        out = (k.to(self._device), v.to(self._device))
        works = [group.send([x], RECEIVER, self._tag) for x in out]
        # NOTE: K and V are on the wire while their checksums are computed; the header follows them
        crcs = [payload.checksum(self.transfer_id, layer.index, i, 0, k.shape[0], x) if first == 0 else 0
                for i, x in enumerate(out)]
        header = torch.tensor([layer.index, first, k.shape[0], *crcs], dtype=torch.int64).to(self._device)
        works.append(group.send([header], RECEIVER, self._tag))
        in_flight.append((works, (k, v, *out, header)))
        if first == 0:
            self.bytes_sent += 2 * k.numel() * k.element_size()
        while len(in_flight) > IN_FLIGHT_LAYERS:
            wait_all(in_flight.popleft()[0], self._wait_until())

    def _fill(self, group: Any, sent: int, in_flight: deque[tuple[list[Any], tuple[torch.Tensor, ...]]]) -> None:
        """The layers after `sent` of a transfer that stopped part-way, as zeros marked FILLER (the pair stays in
        step: the receiver expects every layer of a transfer that started)."""
        if sent >= self.layout.num_layers:
            return
        zeros = torch.zeros((self.num_blocks, *self.layout.block_shape), dtype=self.layout.torch_dtype)
        for index in range(sent, self.layout.num_layers):
            self._send(group, Layer(index, zeros, zeros), in_flight, FILLER)

    def _wait_until(self) -> float:
        """Until when a send may wait: the transfer's deadline, or (stopped, only keeping the pair in step) anew."""
        return self._deadline if not self.state.finished else time.monotonic() + self.config.deadline_s

    def _retire(self, pair: Pair) -> None:
        retire(pair, _pairs, _pairs_lock)


def receiver_side(receiver: KVReceiver, config: TransferConfig, host: str) -> TorchEndpoint:
    """The torch transport's receiving side (the registry's hook)."""
    return TorchEndpoint(receiver, host, config.torch_backend, config.torch_device)
