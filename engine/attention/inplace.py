"""Work plan of the compiled in-place attention kernel (engine/csrc/paged_attention.cpp) for one step.

Built once per step from the block tables and shared by all layers; `run` is what `paged_attention` calls per
layer. An item is a set of query rows attending one key range [kv_lo, kv_hi) of one block table, row j of the item
seeing keys below causal + j + 1 (the kernel's header describes the layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from engine.attention.cascade import SharedPrefix, shared_prefixes

# NOTE: prefill chunks with context of more rows than this go to gather + SDPA: there the gathered context is
# amortized over many rows and SDPA's matrix products beat the kernel's per-row dot products (a 104-row chunk over
# 1,000 cached tokens: 8.3 vs 10.7 ms per layer here); short ones (speculative verification, small chunks) and
# decode read in place.
PREFILL_IN_PLACE_MAX_ROWS = 32
# NOTE: against prefill="flash" (gather + one fused SDPA call, engine/attention/paged.py) the kernel wins only below
# ~4 rows on one thread (900 cached tokens: 2 rows 0.20 vs 0.32 ms per layer, 5 rows 0.64 vs 0.38, 32 rows 3.4 vs 1.2).
PREFILL_IN_PLACE_MAX_ROWS_FLASH = 3

# meta columns, as the kernel reads them
ROW_OFF, ROW_CNT, BLK_OFF, KV_LO, KV_HI, CAUSAL, DIRECT = range(7)


@dataclass
class KernelPlan:
    """The kernel's inputs for one step: items over rows of the flat batch and the block ids they read."""

    kernel: ModuleType
    meta: torch.Tensor  # [I, 7] long
    rows: torch.Tensor  # [R] long: flat query rows of the items, item after item
    blocks: torch.Tensor  # [B] long: the block tables the items index, concatenated
    block_size: int
    groups: list[SharedPrefix]  # the decode entries attending a shared prefix together

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
            out: torch.Tensor) -> None:
        """Write the attention of every row the items name into `out` ([T, H, D], contiguous)."""
        if len(self.meta):
            self.kernel.attend(q, k_cache, v_cache, self.meta, self.rows, self.blocks, self.block_size, scale, out)


def in_place(start: int, num_new: int, flash: bool = True) -> bool:
    """Whether the kernel attends this prefill chunk (it has cached context and few rows); `flash`: the other
    chunks take prefill="flash" (else the older chunked SDPA path)."""
    return start > 0 and num_new <= (PREFILL_IN_PLACE_MAX_ROWS_FLASH if flash else PREFILL_IN_PLACE_MAX_ROWS)


def build_plan(kernel: ModuleType, tables: list[list[int]], starts: list[int], num_new: list[int], num_decode: int,
               block_size: int, cascade: bool = True, flash: bool = True) -> KernelPlan:
    """Items for the decode entries (with shared prefixes grouped when `cascade`) and the short prefill chunks with
    cached context (`in_place`); the other prefill chunks are left to the caller."""
    meta: list[list[int]] = []
    rows: list[int] = []
    blocks: list[int] = []
    offsets: list[int] = []
    for t in tables:
        offsets.append(len(blocks))
        blocks.extend(t)
    ctx = [s + 1 for s in starts[:num_decode]]
    groups = shared_prefixes(tables[:num_decode], ctx, block_size) if cascade else []
    shared = [0] * num_decode
    for g in groups:
        meta.append([len(rows), len(g.members), offsets[g.members[0]], 0, g.num_tokens, g.num_tokens, 0])
        rows.extend(g.members)  # NOTE: decode entry i is flat row i
        for i in g.members:
            shared[i] = g.num_tokens
    for i in range(num_decode):
        meta.append([len(rows), 1, offsets[i], shared[i], ctx[i], ctx[i] - 1, int(shared[i] == 0)])
        rows.append(i)
    q_start = num_decode
    for i in range(num_decode, len(tables)):
        start, n = starts[i], num_new[i]
        if in_place(start, n, flash):
            meta.append([len(rows), n, offsets[i], 0, start + n, start, 1])
            rows.extend(range(q_start, q_start + n))
        q_start += n
    return KernelPlan(kernel, torch.tensor(meta, dtype=torch.long).view(-1, 7), torch.tensor(rows, dtype=torch.long),
                      torch.tensor(blocks, dtype=torch.long), block_size, groups)
