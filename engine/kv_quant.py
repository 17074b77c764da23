"""int8 KV cache (`kv_cache_dtype="int8"`): each block stores its tokens as int8 with one scale per KV head.

Block layout, [block_size + 1, KVH, D] int8: rows 0..block_size-1 hold the tokens' quantized K (or V); row
block_size holds the scales, a float32 per KV head in the first 4 bytes of that head's row.
NOTE: the scales live inside the block so a block is one opaque run of bytes: the KV transfer, `read_kv_layer` and
`write_kv_blocks` move int8 blocks and their scales together without knowing the format, and a block read from
one engine and written into another round-trips exactly.
"""

from __future__ import annotations

import torch

SCALE_ROWS = 1  # rows appended to each int8 block for its scales
_QMAX = 127.0


def int8_block_rows(block_size: int) -> int:
    """Rows of one int8 block in the cache (tokens + the scale row)."""
    return block_size + SCALE_ROWS


def block_scales(blocks: torch.Tensor, block_size: int) -> torch.Tensor:  # [n, bs + 1, KVH, D] → [n, KVH]
    """The per-head scales stored in the blocks' scale row."""
    n, _, kvh, _ = blocks.shape
    return blocks[:, block_size, :, :4].contiguous().view(torch.float32).view(n, kvh)


def dequantize_blocks(blocks: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, bs + 1, KVH, D] int8 → [n, bs, KVH, D] in `dtype`."""
    scales = block_scales(blocks, block_size).to(dtype)  # [n, KVH]
    return blocks[:, :block_size].to(dtype) * scales[:, None, :, None]


def gather_dequantized(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks `block_ids` of an int8 cache ([num_blocks, bs + 1, KVH, D]) as [n, bs, KVH, D] in `dtype`."""
    return dequantize_blocks(cache.index_select(0, block_ids), cache.shape[1] - SCALE_ROWS, dtype)


def write_quantized(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new tokens' K or V ([T, KVH, D]) at `slot_mapping` (block * block_size + offset) of an int8 cache.

    Every block written to is requantized as a whole: its filled slots (up to the last one written now) are
    dequantized, the new tokens put in, and a new per-head scale taken from their absolute maximum.
    NOTE: slots past the last one written hold stale data (a previous owner's, or drafts rolled back); they are
    zeroed so they never inflate a scale. Tokens fill a block in order, so what lies past them is never read.
    """
    bs = cache.shape[1] - SCALE_ROWS
    kvh, d = x.shape[1:]
    block_of, offset = slot_mapping // bs, slot_mapping % bs
    blocks, inverse = torch.unique(block_of, return_inverse=True)  # [u], [T]
    cur = gather_dequantized(cache, blocks, torch.float32)  # [u, bs, KVH, D]
    cur[inverse, offset] = x.float()
    filled = torch.zeros(len(blocks), dtype=torch.long, device=cache.device)
    filled = filled.scatter_reduce(0, inverse, offset, "amax")  # [u]
    keep = torch.arange(bs, device=cache.device)[None, :] <= filled[:, None]  # [u, bs]
    cur = cur * keep[:, :, None, None]
    scale = (cur.abs().amax(dim=(1, 3)) / _QMAX).clamp_min(1e-8)  # [u, KVH]
    q = torch.round(cur / scale[:, None, :, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    out = torch.zeros(len(blocks), bs + SCALE_ROWS, kvh, d, dtype=torch.int8, device=cache.device)
    out[:, :bs] = q
    out[:, bs, :, :4] = scale.contiguous().view(torch.int8).view(len(blocks), kvh, 4)
    cache.index_copy_(0, blocks, out)
