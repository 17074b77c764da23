"""KV data as it travels: tensors as bytes (no copy where possible) and the CRC32 every chunk carries."""

from __future__ import annotations

import warnings
import zlib

import torch

from engine.kv_export import KVLayout


def as_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes (no copy)."""
    assert t.is_contiguous() and t.device.type == "cpu"
    return memoryview(t.view(torch.uint8).numpy()).cast("B") if t.numel() else memoryview(b"")  # type: ignore[arg-type]


def crc32(t: torch.Tensor | bytes | memoryview) -> int:
    """CRC32 of a tensor's bytes (zlib releases the GIL on large buffers)."""
    return zlib.crc32(as_bytes(t) if isinstance(t, torch.Tensor) else t)


def tensor_from_bytes(data: bytes, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """Blocks received as bytes, viewed (no copy) as [num_blocks, block_size, KVH, D]; only ever read from."""
    with warnings.catch_warnings():  # NOTE: the view of immutable bytes is read-only by contract, torch warns anyway
        warnings.simplefilter("ignore", UserWarning)
        t = torch.frombuffer(data, dtype=torch.uint8)
    return t.view(layout.torch_dtype).view(num_blocks, *layout.block_shape)


def block_nbytes(layout: KVLayout) -> int:
    """Bytes of K (or V) of one block in one layer."""
    return layout.layer_nbytes(1) // 2
