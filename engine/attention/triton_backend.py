"""The Triton backend: its per-step metadata (host-built, shapes that depend only on the batch's shape) and the glue
that launches engine/attention/triton_kernels.py.

A step's flat batch is `num_decode` decode rows (one query each) and then prefill chunks. Decode rows go to the
split-KV decode kernel and its log-sum-exp merge; prefill chunks with cached context (chunked prefill, speculative
verification) and short chunks that start their sequence to the varlen prefill kernel, all in one launch; long
chunks that start their sequence to SDPA over their own K/V (flash on CUDA). The kernels module imports Triton, so
it is imported on first use only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# NOTE: split-KV: a decode row's keys are cut into `num_splits` ranges attended by separate programs (more programs
# for few long sequences), merged by log-sum-exp. The count depends only on the metadata's shapes (batch rows,
# block-table width), never on the lengths, so a CUDA graph captured for a shape stays valid for every batch of it.
SPLIT_MIN_TOKENS = 256  # no split shorter than this (its partial result and merge would cost more than it saves)
SPLIT_TARGET_PROGRAMS = 128  # rows x splits aimed at (x KV heads: enough programs to fill an H100's 132 SMs)
MAX_SPLITS = 16
# NOTE: a chunk that starts its sequence goes to SDPA (flash) from this many rows: one call per chunk, which pays
# for long prompts (flash's tiling); shorter ones join the one varlen launch (a batch of many short prompts would
# otherwise cost a call each per layer).
SDPA_MIN_ROWS = 256
# NOTE: Triton compiles a kernel once per set of constexprs and per integer argument that is 1, divisible by 16, or
# neither. The split count is a constexpr and a block table's width an argument (its row stride): left free, an
# eager step (prefill and decode rows together, as a colocated worker runs) met new values batch after batch and
# waited for a compile each time, ~0.5-1 s (on an H200, issue 38: colocated ITL p99 93-808 ms, worst at the first
# rate of each sweep). Split counts are powers of two (the decode graphs' buckets compile all of them at start) and
# widths multiples of TABLE_ALIGN, as cdiv(max_model_len, block_size) is for the usual lengths.
TABLE_ALIGN = 16


def num_kv_splits(rows: int, max_blocks: int, block_size: int) -> int:
    """Key ranges per decode row for a batch of `rows` rows and block tables `max_blocks` wide: a power of two."""
    by_len = max(1, max_blocks * block_size // SPLIT_MIN_TOKENS)
    by_rows = max(1, -(-SPLIT_TARGET_PROGRAMS // max(rows, 1)))
    return 1 << (min(by_len, by_rows, MAX_SPLITS).bit_length() - 1)


def aligned_width(width: int) -> int:
    """A block table's width rounded up to a multiple of `TABLE_ALIGN` (0 stays 0)."""
    return -(-width // TABLE_ALIGN) * TABLE_ALIGN


@dataclass
class TritonMetadata:
    """What the Triton kernels read for one step; every tensor is on the device (a view of one packed buffer)."""

    block_tables: torch.Tensor  # [B, max_blocks] int32: decode rows' block tables, padded with `pad_block`
    seq_lens: torch.Tensor  # [B] int32: tokens each decode row attends (its context, the new token included)
    num_splits: int  # key ranges per decode row (num_kv_splits of the shapes above)
    q_start: torch.Tensor  # [P] int32: flat row of the first query of each chunk the varlen kernel attends
    q_lens: torch.Tensor  # [P] int32: its query rows
    ctx_lens: torch.Tensor  # [P] int32: tokens with KV after this step (cached context + the chunk)
    ctx_block_tables: torch.Tensor  # [P, max_ctx_blocks] int32
    max_q_len: int  # longest of those chunks (the prefill kernel's grid; 0 when none)
    own: list[tuple[int, int]]  # (first flat row, rows) of chunks that start their sequence, >= SDPA_MIN_ROWS (SDPA)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors in packing order (engine/attention/pack.py)."""
        return [self.block_tables, self.seq_lens, self.q_start, self.q_lens, self.ctx_lens, self.ctx_block_tables]

    def with_tensors(self, t: list[torch.Tensor]) -> TritonMetadata:
        """The same metadata over other tensors (the packed device views), in `tensors()` order."""
        return TritonMetadata(t[0], t[1], self.num_splits, t[2], t[3], t[4], t[5], self.max_q_len, self.own)


def _table(rows: list[list[int]], width: int, pad: int) -> torch.Tensor:
    # NOTE: numpy rows, not a tensor per row (torch.tensor per row was most of a 64-row step's build)
    out = np.full((len(rows), width), pad, dtype=np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def build_triton(block_tables: list[list[int]], starts: list[int], num_new: list[int], num_decode: int,
                 block_size: int, pad_rows: int, pad_blocks: int, pad_block: int) -> TritonMetadata:
    """Host tensors for a step: decode rows padded to `pad_rows` rows (seq_len 1 over block `pad_block`) and block
    tables padded to `pad_blocks` columns (with `pad_block`)."""
    dec = block_tables[:num_decode]
    rows = max(num_decode, pad_rows)
    # NOTE: a graph's static buffers are `pad_blocks` wide; an eager step's width is aligned (TABLE_ALIGN)
    longest = max([0] + [len(t) for t in dec])
    width = pad_blocks if pad_blocks >= longest else aligned_width(longest)
    bt = _table(dec + [[pad_block]] * (rows - num_decode), width, pad_block)
    seq_lens = torch.tensor([s + 1 for s in starts[:num_decode]] + [1] * (rows - num_decode), dtype=torch.int32)
    ctx: list[int] = []
    flat: list[int] = []  # the first flat row of each chunk in `ctx`
    own: list[tuple[int, int]] = []
    q_start = num_decode
    for i in range(num_decode, len(num_new)):
        if starts[i] > 0 or num_new[i] < SDPA_MIN_ROWS:
            ctx.append(i)
            flat.append(q_start)
        else:
            own.append((q_start, num_new[i]))
        q_start += num_new[i]
    ctx_width = aligned_width(max([0] + [len(block_tables[i]) for i in ctx]))
    return TritonMetadata(
        bt, seq_lens, num_kv_splits(rows, width, block_size),
        torch.tensor(flat, dtype=torch.int32), torch.tensor([num_new[i] for i in ctx], dtype=torch.int32),
        torch.tensor([starts[i] + num_new[i] for i in ctx], dtype=torch.int32),
        _table([block_tables[i] for i in ctx], ctx_width, 0), max([0] + [num_new[i] for i in ctx]), own)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           meta: TritonMetadata, scale: float, out: torch.Tensor) -> None:
    """Write every row's attention into `out` ([T, H, D]); q [T, H, D], k/v [T, KVH, D] (already in the cache)."""
    import engine.attention.triton_kernels as tk

    if meta.seq_lens.numel():
        tk.decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.num_splits, scale, out)
    if meta.max_q_len:
        tk.prefill(q, k_cache, v_cache, meta.q_start, meta.q_lens, meta.ctx_lens, meta.ctx_block_tables,
                   meta.max_q_len, scale, out)
    for start, n in meta.own:
        rows = slice(start, start + n)
        qh, kh, vh = q[rows].transpose(0, 1)[None], k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)


def write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V ([T, KVH, D]) into their slots of the paged caches (one kernel launch for both)."""
    import engine.attention.triton_kernels as tk

    tk.write_kv(k_cache, v_cache, k, v, slot_mapping)
