"""The `nixl` transport, receiving side: the decode engine's pool registered once, notifications checked, the fence.

1. The endpoint registers the engine's KV pool with this process's agent when it starts (the metadata a sender
   loads must already cover it);
2. a sender's `Watch` call opens (`watch`): transfers it prepares are attached to that watch;
3. `prepare` answers with a `NixlTarget` (the receiver's agent, its metadata unless the sender holds it, the pool:
   each TP rank's and the KV heads it holds, the reserved block ids) and fences the transfer: from now on the sender
   may write into those blocks (a sender whose ranks split the KV heads otherwise makes this pool's ranks' blocks
   itself: `nixl_reshard.py`);
4. the notification thread reads the per-layer notifications, checks the landed blocks against the sender's check
   of them, and marks the layer received (a mismatch fails the transfer as retryable);
5. the fence is lifted, and a failed transfer's blocks freed, once no write of the sender can be in flight: it
   committed, it said so (`Abort.quiesced`), every layer's notification came, or its Watch ended (the sender died
   or dropped the pair; NIXL is driven for `DRAIN_S` first, for what UCX already received).

Progress: no NIXL progress thread. The notification thread sleeps on a condition while no transfer is open here,
and polls NIXL (which also moves data arriving over UCX's TCP transport) while one is, backing off when idle.
A sender on this host (its Watch comes from a local address) writes with UCX's one-sided copies (cma between
processes, cuda_ipc between GPUs): its bytes land without a poll here, and only its notifications wait for one, so
while none has come for `BURST_S` the thread polls every `LOCAL_POLL_S`, fast again as soon as one comes (a sender
posts its layers in a burst after a prefill on the host) and from its commit (`_hurry`) on. Polled at
`FAST_POLL_S` throughout, a decode worker's notification thread took ~10 ms of the decode core per SmolLM2
hand-off of a 75-token prompt (it polled through the whole prefill; 3.7 ms after: `pdcluster bench path`'s thread
table, BENCHMARKS.md), time taken from the steps of every stream that worker decodes meanwhile.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.errors import InvalidRequestError
from engine.parallel.shard import kv_heads_of
from kv_transfer.inbound import Inbound
from kv_transfer.messages import NixlTarget, PrepareRequest
from kv_transfer.pool import pool_heads, pool_tensors
from kv_transfer.receiver import KVReceiver
from kv_transfer.state import TransferConfig, TransferError, TransferState
from kv_transfer.transports import cuda_ipc, nixl_agent
from kv_transfer.transports.nixl_checks import layers_check
from kv_transfer.transports.nixl_reshard import heads_problem

log = logging.getLogger(__name__)

DRAIN_S = 0.1  # after a sender's Watch ended: NIXL driven this long before its transfers' blocks are freed
FAST_POLL_S, SLOW_POLL_S = 0.00005, 0.005  # poll interval while data moves / after `BACKOFF_S` without news
BACKOFF_S = 0.05
LOCAL_POLL_S = 0.0005  # senders on this host only, while no notification came for `BURST_S` (see the module doc)
BURST_S = 0.001  # notifications came this recently: more are likely on their way (a sender posting its layers)
HURRY_S = 0.01  # after a commit: polled fast this long (its last notifications are due)


def on_this_host(peer: str) -> bool:
    """Whether a gRPC peer address ("ipv4:10.0.0.5:5123", "ipv6:[::1]:5123", "unix:...") is on this host: an address
    a socket here can bind to. False when unsure (another network namespace on the same machine included)."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    family = {"ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}.get(kind)
    if family is None:
        return False
    host = urllib.parse.unquote(rest.rsplit(":", 1)[0]).strip("[]")
    if not host:
        return False  # NOTE: binding "" means any address, which always works
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
    except (OSError, ValueError):
        return False
    return True


@dataclass
class _Watch:
    """A sender agent's open Watch call and the transfers it prepared while it was open."""

    agent: str
    local: bool = False  # the sender is on this host: its writes land without this side's progress
    transfers: set[str] = field(default_factory=set)
    open: bool = True


class NixlEndpoint:
    """Receiver side: the registered pool, the Watch bookkeeping, the notification thread (see the module doc)."""

    def __init__(self, receiver: KVReceiver, config: TransferConfig) -> None:
        self.receiver, self.config = receiver, config
        self.agent = nixl_agent.agent()
        self.pool = self.agent.pool(pool_tensors(receiver.engine))  # NOTE: a TP group's: one per rank
        self.heads = pool_heads(receiver.engine)  # the KV heads each rank's pool holds
        # NOTE: a GPU pool is also shared through CUDA IPC, for senders on this node (the module doc of cuda_ipc)
        self.cuda_ipc = cuda_ipc.export(self.pool.kv) if len(self.pool.kvs) == 1 else b""
        self._watches: dict[str, _Watch] = {}  # sender agent → its open watch
        self._open: dict[str, tuple[Inbound, _Watch]] = {}  # transfer id → (transfer, its watch), until settled
        self._cond = threading.Condition()
        self._closed = False
        receiver.on_prepare, receiver.on_watch, receiver.transport = self.prepare, self.watch, "nixl"
        self._wake = threading.Event()  # set: poll NIXL now and fast again (a commit came)
        receiver.on_commit = self._hurry
        self._thread = threading.Thread(target=self._notifications, daemon=True, name="kv-nixl-notifs")
        self._thread.start()

    # ---- 2. watch -----------------------------------------------------------------------------------------------
    def watch(self, agent: str, peer: str = "") -> Callable[[], None]:
        """A sender's Watch opened (`peer`: its gRPC peer address); returns what to call when it ends."""
        w = _Watch(agent, on_this_host(peer))
        with self._cond:
            old = self._watches.get(agent)
            self._watches[agent] = w
        if old is not None:
            self._ended(old)  # NOTE: the sender dropped the pair and opened a new one
        return lambda: self._ended(w)

    def _ended(self, w: _Watch) -> None:
        with self._cond:
            if not w.open:
                return
            w.open = False
            if self._watches.get(w.agent) is w:
                del self._watches[w.agent]
            fenced = [self._open[tid][0] for tid in w.transfers if tid in self._open]
        if not fenced:
            return
        until = time.monotonic() + DRAIN_S
        while time.monotonic() < until:
            self._poll()
            time.sleep(FAST_POLL_S)
        for t in fenced:
            if t.state is TransferState.TRANSFERRING:
                self.receiver.fail(t.transfer_id, f"sender {w.agent} went away", retryable=True)
            self.receiver.unfence(t)

    # ---- 3. handshake -------------------------------------------------------------------------------------------
    def prepare(self, req: PrepareRequest, t: Inbound) -> NixlTarget:
        with self._cond:
            w = self._watches.get(req.nixl_agent)
            if w is None:
                raise TransferError(f"nixl: sender agent {req.nixl_agent!r} has no open Watch", req.request_id,
                                    retryable=True)
            if not req.nixl_agent:
                raise InvalidRequestError("nixl_agent", "is required for transport nixl", req.request_id)
            self._check_heads(req)
            w.transfers.add(t.transfer_id)
            self._open[t.transfer_id] = (t, w)
            if t.num_blocks:  # NOTE: with every block cached there is nothing to write (and no notification)
                self.receiver.fence(t)
                self.receiver.set_receiving(t, True)
            self._cond.notify_all()
        pool = self.pool
        if t.num_blocks and pool.kv.device.type == "cuda":
            # NOTE: the reserved blocks were free, but kernels the engine queued before they were freed may not have
            # run yet (a lookahead step writes each sequence's next slot: engine/model_runner.py); NIXL writes on
            # UCX's streams, unordered with the engine's, so the sender learns their ids only once those have run
            torch.cuda.current_stream(pool.kv.device).synchronize()
        return NixlTarget(self.agent.name, b"" if req.nixl_known == self.agent.name else self.agent.metadata,
                          pool.kv.data_ptr(), pool.num_blocks, pool.mem, pool.device, list(t.res.fresh_blocks),
                          [kv.data_ptr() for kv in pool.kvs[1:]], self.cuda_ipc, self.heads)

    def _check_heads(self, req: PrepareRequest) -> None:
        """Refuse, naming the field, a sender whose ranks' pools cannot make this pool's (nixl_reshard.py): they
        leave a KV head out, or they split the heads otherwise and this pool is on a GPU (gathered on the host)."""
        cfg, n = self.receiver.engine.model_config, req.nixl_shards
        # NOTE: none said: the split a TP group of that size makes (engine/parallel/shard.py)
        heads = req.nixl_heads or [(h.start, h.stop) for h in (kv_heads_of(cfg, r, n) for r in range(n))]
        problem = heads_problem(heads, n, self.receiver.layout.num_kv_heads)
        if problem is not None:
            raise InvalidRequestError("nixl_heads", problem, req.request_id)
        if self.pool.mem != "DRAM" and any(h not in heads for h in self.heads):
            raise InvalidRequestError("nixl_shards", f"the sender's {n} TP ranks hold KV heads {heads}, this GPU "
                                      f"pool's ranks {self.heads}: nixl gathers heads between host pools only (use "
                                      "grpc)", req.request_id)

    # ---- 4. notifications ---------------------------------------------------------------------------------------
    def _notifications(self) -> None:
        last_news, hurried = time.monotonic(), 0.0
        while True:
            with self._cond:
                self._prune()
                while not self._open and not self._closed:
                    self._cond.wait()  # NOTE: idle: no CPU spent
                    last_news = time.monotonic()
                if self._closed:
                    return
                local = all(w.local for _, w in self._open.values())
            if self._poll():
                last_news = time.monotonic()
            if self._wake.wait(self._interval(time.monotonic(), last_news, hurried, local)):
                self._wake.clear()
                last_news = hurried = time.monotonic()

    @staticmethod
    def _interval(now: float, last_news: float, hurried: float, local: bool) -> float:
        """How long to wait before the next poll (see the module doc)."""
        if now - last_news >= BACKOFF_S:
            return SLOW_POLL_S
        if local and now - hurried >= HURRY_S and now - last_news >= BURST_S:
            return LOCAL_POLL_S
        return FAST_POLL_S

    def _hurry(self) -> None:
        """A commit came: its last layers' notifications are due now, poll fast again.

        NOTE: layer-wise, layers come one prefill layer apart (~0.1 s for 2,048 tokens on one thread): the thread
        has backed off to `SLOW_POLL_S` by the last one, and the commit waited for the next slow poll (up to 5 ms
        of the tail after the prefill, issue 30's send profile).
        """
        self._wake.set()

    def _prune(self) -> None:
        """Forget transfers that need no more notifications (under `_cond`)."""
        for tid, (t, w) in list(self._open.items()):
            if t.state is TransferState.DONE or (t.state is TransferState.FAILED and not t.fenced):
                del self._open[tid]
                w.transfers.discard(tid)

    def _poll(self) -> bool:
        """Drive NIXL once and handle what arrived; True if anything did."""
        try:
            got = self.agent.notifications()
        except Exception as e:  # noqa: BLE001 - never let the thread die on a NIXL error
            log.warning("nixl notifications: %s", e)
            return False
        for sender, msgs in got.items():
            for msg in msgs:
                self._landed(sender, msg)
        return bool(got)

    def _landed(self, sender: str, msg: bytes) -> None:
        try:
            tid, layer_s, check_k, check_v = msg.decode().split(":")
            layer = int(layer_s)
        except ValueError:
            log.warning("nixl: malformed notification from %s", sender)
            return
        with self._cond:
            entry = self._open.get(tid)
        if entry is None or entry[1].agent != sender or not 0 <= layer < self.receiver.layout.num_layers:
            return  # NOTE: a transfer already settled, or not this sender's
        # NOTE: checked here, on the notification thread: checking on other threads (this one driving NIXL meanwhile)
        # measured slower on the 2-core machine (BENCHMARKS.md): each end already keeps a core busy
        t = entry[0]
        ids = np.asarray(t.res.fresh_blocks, dtype=np.int64)
        kvs = self.pool.kvs
        bad = [which for which, theirs in ((0, check_k), (1, check_v))
               if layers_check(kvs, layer, which, ids, f"{tid}/{layer}/{which}", like=theirs) != theirs]
        if bad:
            self.receiver.fail(tid, f"checksum mismatch in layer {layer} {'KV'[bad[0]]} (nixl)", retryable=True)
        # NOTE: also for a failed transfer: this layer's write is no longer in flight (the fence counts layers)
        all_landed = self.receiver.landed(t, layer, 0 if bad else 2 * len(ids) * self.pool.block_nbytes * len(kvs))
        if all_landed and t.state is TransferState.FAILED:
            self.receiver.unfence(t)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)


def receiver_side(receiver: KVReceiver, config: TransferConfig, host: str) -> NixlEndpoint:
    """The nixl transport's receiving side (the registry's hook)."""
    return NixlEndpoint(receiver, config)
