"""The vocabulary every transport shares: transfer states, the typed failure, and the transfer settings."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, get_args

from engine.errors import CapacityError, EngineError

if TYPE_CHECKING:
    from kv_transfer.tls import KVTls

# NOTE: "local" is sender and receiver in one process (the colocated engine, tests); a cluster's YAML offers only
# the remote two
Transport = Literal["grpc", "torch", "local", "nixl"]
TRANSPORTS: tuple[Transport, ...] = get_args(Transport)


class TransferState(enum.Enum):
    """Where a transfer is; callers poll it (SGLang's KVPoll, reduced to what we need)."""

    WAITING = "waiting"  # created; handshake not done yet
    TRANSFERRING = "transferring"  # blocks reserved on the receiver, data on its way
    DONE = "done"  # every block arrived intact and the sender committed
    FAILED = "failed"  # see `error`; every block reserved or pinned for it is freed

    @property
    def finished(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


class TransferError(EngineError):
    """A transfer failed; `reason` says why, `retryable` whether sending again may succeed."""

    def __init__(self, reason: str, request_id: str | None = None, *, retryable: bool = False) -> None:
        self.retryable = retryable
        super().__init__(reason, request_id)


def as_transfer_error(err: EngineError, request_id: str | None = None) -> TransferError:
    """An engine error met during a transfer, as the sender sees it: a full pool may free up, a bad layout not."""
    if isinstance(err, TransferError):
        return err
    return TransferError(str(err), err.request_id or request_id, retryable=isinstance(err, CapacityError))


@dataclass(frozen=True)
class TransferConfig:
    """How KV moves from prefill to decode workers (one per cluster; sizes in bytes, times in seconds)."""

    transport: Transport = "grpc"
    deadline_s: float = 30.0  # a transfer not committed by then fails and frees its blocks on both sides
    chunk_bytes: int = 1 << 20  # grpc: data per chunk message (1 MiB measured best for Python gRPC)
    grpc_streams: int = 2  # grpc: parallel Push streams, each its own TCP connection
    torch_backend: str = "gloo"  # torch: "gloo" (CPU) or "nccl" (GPU)
    torch_device: str = "cpu"  # torch: where the tensors sent live ("cuda" for nccl: staged from the CPU pool)
    # the shared secret KV endpoints require of every caller ("" = no check); never printed
    cluster_token: str = field(default="", repr=False)
    tls: KVTls | None = field(default=None, repr=False)  # mutual TLS on the gRPC KV plane (None: cleartext)
    # nixl: check each layer's blocks against the sender's checksum before commit (CRC32C in host memory, a word
    # sum on the GPU); False skips it (links with their own CRC, e.g. NVLink or InfiniBand, only)
    nixl_checksum: bool = True

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport: must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.deadline_s <= 0:
            raise ValueError("deadline_s: must be positive")
        if not 4096 <= self.chunk_bytes <= 64 << 20:
            raise ValueError("chunk_bytes: must be in [4 KiB, 64 MiB]")
        if not 1 <= self.grpc_streams <= 16:
            raise ValueError("grpc_streams: must be in [1, 16]")
        if self.torch_backend not in ("gloo", "nccl"):
            raise ValueError(f"torch_backend: must be 'gloo' or 'nccl', got {self.torch_backend!r}")
        if self.transport == "nixl" and self.tls is not None:
            raise ValueError("tls: NIXL does not encrypt; transport 'nixl' cannot run with tls (use 'grpc')")
        if self.torch_backend == "nccl" and not self.torch_device.startswith("cuda"):
            raise ValueError("torch_device: nccl sends CUDA tensors; set torch_device to 'cuda'")
        if self.torch_backend == "gloo" and self.torch_device != "cpu":
            raise ValueError("torch_device: gloo sends host tensors only; set torch_device to 'cpu' (or use nccl)")
