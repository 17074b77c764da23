"""Between engine objects and the wire: layouts to and from proto, checksums, tensors as bytes."""

from __future__ import annotations

import warnings
import zlib

import torch

from engine.kv_export import KVLayout
from kv_transfer.v1 import kv_transfer_pb2 as pb


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(scope=layout.scope, dtype=layout.dtype, num_layers=layout.num_layers,
                       block_size=layout.block_size, num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim)


def layout_from_proto(msg: pb.KVLayout) -> KVLayout:
    return KVLayout(msg.scope, msg.dtype, msg.num_layers, msg.block_size, msg.num_kv_heads, msg.head_dim)


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
    return layout.layer_nbytes(1) // 2
