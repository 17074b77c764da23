"""One host-to-device copy for a step's metadata: host tensors packed into one (pinned) byte buffer, copied once,
and viewed back as the original tensors on the device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_ALIGN = 8  # bytes: every tensor starts at a multiple of the largest itemsize packed (int64)


@dataclass
class Packed:
    """Tensors that live in one buffer: `tensors[i]` is a view of `buffer` (on the device); `host` is the packed
    source the device buffer was copied from (pinned for CUDA)."""

    buffer: torch.Tensor  # [bytes] uint8
    host: torch.Tensor  # [bytes] uint8
    tensors: list[torch.Tensor]
    layout: list[tuple[tuple[int, ...], torch.dtype]]  # shape and dtype of each tensor


def _offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    return offsets, max(total, _ALIGN)


def _views(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    return [buffer[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for t, o in zip(tensors, offsets)]


def pack(tensors: Sequence[torch.Tensor], device: torch.device, pin: bool | None = None) -> Packed:
    """Copy host `tensors` to `device` with one (non-blocking) transfer; on the CPU the pack is the result. The
    host pack is pinned for CUDA (or as `pin` says)."""
    offsets, total = _offsets(tensors)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda" if pin is None else pin)
    for dst, src in zip(_views(host, tensors, offsets), tensors):
        dst.copy_(src)
    # NOTE: non_blocking from pinned memory: the copy is queued on the stream and the host goes on building; the
    # kernels that read the buffer are queued after it on the same stream.
    buffer = host if device.type == "cpu" else host.to(device, non_blocking=True)
    return Packed(buffer, host, _views(buffer, tensors, offsets), [(tuple(t.shape), t.dtype) for t in tensors])
