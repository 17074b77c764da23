"""An inbound transfer as the decode side's KVReceiver holds it: its reservation, deadline and which blocks arrived."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from engine.kv_import import KVReservation
from kv_transfer.state import TransferError, TransferState


@dataclass
class Inbound:
    """One transfer in flight towards this engine."""

    transfer_id: str
    res: KVReservation
    deadline: float  # time.monotonic()
    received: np.ndarray  # [num_layers, 2, num_blocks] bool: which blocks arrived intact
    lifetime: float = 0.0  # seconds: the sender's deadline, run again from each keep-alive and the first data
    data_started: bool = False  # some data arrived: the deadline no longer moves
    state: TransferState = TransferState.TRANSFERRING
    error: TransferError | None = None
    writers: int = 0  # writes into the reserved blocks in progress: freeing waits for them
    receiving: bool = False  # a transport thread is still pulling this transfer's data (torch): commit waits
    fenced: bool = False  # the sender may still write into the reserved blocks itself (nixl): freeing waits
    freed: bool = False
    next_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    bytes_received: int = 0
    attempt_id: str = ""  # the sender's id of the handshake (`PrepareRequest.attempt_id`)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def request_id(self) -> str:
        return self.res.request_id

    @property
    def num_blocks(self) -> int:
        return self.received.shape[2]
