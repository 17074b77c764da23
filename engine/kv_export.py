"""What an engine's KV blocks look like from outside: the layout a transfer describes before it moves a byte.

A sender announces its layout first; a receiver writes blocks into its pool only if every field equals its own
(cache scope, dtype, layer count, block shape). Leading blocks the receiver already caches are not sent at all.
An int8 KV cache (`dtype` "int8") has one more row per block, holding its per-head scales (engine/kv_quant.py),
so its blocks travel as opaque bytes like any other; a float and an int8 engine never accept each other's blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.kv_quant import SCALE_ROWS


@dataclass(frozen=True)
class KVLayout:
    """What KV blocks must match to be written into an engine's pool (sent first in every transfer)."""

    scope: str  # model id and KV dtype: only an engine with the same scope may use the blocks
    dtype: str  # torch dtype name of the KV cache, e.g. "float32", or "int8" (blocks carry their scales)
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of K (or V) in one layer as it is stored and sent."""
        rows = self.block_size + (SCALE_ROWS if self.dtype == "int8" else 0)
        return (rows, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    def layer_nbytes(self, num_blocks: int) -> int:
        """Bytes of K and V of `num_blocks` blocks in one layer."""
        return 2 * num_blocks * math.prod(self.block_shape) * self.torch_dtype.itemsize
