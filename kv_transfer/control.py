"""What a KV sender talks through and sends: the control plane to one receiver, and one layer's blocks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kv_transfer.messages import Abort, Commit, Prepared, PrepareRequest


class Control(ABC):
    """The control plane to one receiver: the handshake, commit and abort (gRPC, or a direct call in-process)."""

    @abstractmethod
    def prepare(self, req: PrepareRequest, timeout: float) -> Prepared: ...

    @abstractmethod
    def commit(self, req: Commit, timeout: float) -> int:
        """Returns the bytes the receiver got."""

    @abstractmethod
    def abort(self, req: Abort, timeout: float) -> None: ...

    @abstractmethod
    def keep_alive(self, transfer_id: str, timeout: float) -> None:
        """The transfer is still wanted: the receiver's deadline runs again from now (until its first data)."""


@dataclass
class Layer:
    """One layer's K and V of the blocks to send, each [num_blocks, block_size, KVH, D]."""

    index: int
    k: torch.Tensor
    v: torch.Tensor
