"""What an engine's KV blocks look like from outside: the layout a transfer describes before it moves a byte.

A sender announces its layout first; a receiver writes blocks into its pool only if every field equals its own
(cache scope, dtype, layer count, block shape). Leading blocks the receiver already caches are not sent at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """What KV blocks must match to be written into an engine's pool (sent first in every transfer)."""

    scope: str  # model id and KV dtype: only an engine with the same scope may use the blocks
    dtype: str  # torch dtype name, e.g. "float32"
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)  # type: ignore[no-any-return]

    def layer_nbytes(self, num_blocks: int) -> int:
        """Bytes of K and V of `num_blocks` blocks in one layer."""
        return 2 * num_blocks * self.block_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize
