"""The `nixl` sender's per-process state: its Watch call to each receiver and the agents whose metadata it loaded.

A receiver keeps the blocks of every transfer a sender's process prepared fenced while that process's Watch call
is open (`nixl_receiver.py`); dropping a pair ends the call, which lifts the fence there. A handshake given up
before its answer came is named in an `Abort` sent again while the pair lives (`abort_attempt`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

from kv_transfer.messages import Abort
from kv_transfer.state import TransferError
from kv_transfer.transports import nixl_agent
from kv_transfer.transports.grpc_control import GrpcControl, channel, transfer_error
from kv_transfer.v1 import kv_transfer_pb2 as pb
from kv_transfer.v1 import kv_transfer_pb2_grpc as pb_grpc

ABORT_RETRY_S = 0.5  # a handshake's abort that did not get through is sent again this often (while the pair lives)


class Link:
    """This process's Watch call to one receiver address (held open while any transfer may write there)."""

    def __init__(self, control: GrpcControl) -> None:
        stub = pb_grpc.KVTransferStub(channel(control.address, 0, control.cluster_token, control.tls))
        self.call: Any = stub.Watch(pb.WatchRequest(agent=nixl_agent.agent().name))
        try:
            next(self.call)  # NOTE: the receiver answers once the watch holds; only then may anything be written
        except grpc.RpcError as e:
            raise transfer_error(e, "", f"watch at {control.address}") from None
        except StopIteration:
            raise TransferError(f"watch at {control.address} ended at once", retryable=True) from None

    @property
    def alive(self) -> bool:
        return not self.call.done()

    def close(self) -> None:
        self.call.cancel()


_links: dict[str, Link] = {}
_lock = threading.Lock()
known: dict[str, str] = {}  # receiver address → the agent name whose metadata this process loaded


def link(control: GrpcControl) -> Link:
    """The open Watch call to `control`'s receiver (opened now if there is none, or it ended)."""
    with _lock:
        current = _links.get(control.address)
        if current is None or not current.alive:
            current = _links[control.address] = Link(control)
        return current


def alive(address: str) -> bool:
    """Whether this process's Watch call to `address` is open."""
    with _lock:
        current = _links.get(address)
    return current is not None and current.alive


def drop(address: str, agent_name: str) -> None:
    """Give a pair up: the peer's metadata and connection go (its posted writes with them), the Watch ends."""
    nixl_agent.agent().forget(agent_name)
    with _lock:
        known.pop(address, None)
        current = _links.pop(address, None)
    if current is not None:
        current.close()


def abort_attempt(control: GrpcControl, attempt_id: str, reason: str, deadline_s: float) -> None:
    """Tell the receiver that the handshake `attempt_id` was given up before its answer came (it may still answer
    it, and fence what it reserved): tried again until it gets through, the Watch ends or `deadline_s` passed."""
    msg = Abort("", f"handshake given up: {reason}", quiesced=True, attempt_id=attempt_id)
    until = time.monotonic() + deadline_s
    while True:
        try:
            control.abort(msg, 2.0)
            return
        except TransferError:
            pass
        if not alive(control.address) or time.monotonic() > until:
            return  # NOTE: the Watch ended: the receiver lifts the fence of everything this process prepared
        time.sleep(ABORT_RETRY_S)
