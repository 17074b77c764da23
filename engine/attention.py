"""Attention over paged KV blocks, for a flat batch of decode tokens and variable-length prefill chunks.

`paged_attention` is the one kernel seam: a GPU kernel (flash/paged attention) replaces this function and
nothing else. Everything that depends only on the batch (slots, padded block tables, masks) is built once per
step in `AttentionMetadata` and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """A chunk of `q_len` query tokens of one sequence, starting at flat index `q_start`."""

    q_start: int
    q_len: int
    context_len: int  # tokens with KV after this step (cached prefix + this chunk)
    block_table: torch.Tensor  # [num_blocks] long
    mask: torch.Tensor | None  # [q_len, context_len] bool; None when the chunk starts the sequence


@dataclass
class AttentionMetadata:
    """Per-step layout of the flat token batch: `num_decode` single-token entries, then prefill spans."""

    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset, where each new token's K/V goes
    num_decode: int
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] long, padded with block 0
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool: True = attend
    prefills: list[PrefillSpan]

    @staticmethod
    def build(
        block_tables: list[list[int]], starts: list[int], num_new: list[int], block_size: int
    ) -> AttentionMetadata:
        """Lay out a step: sequence i computes tokens [starts[i], starts[i] + num_new[i]) (decode entries first)."""
        slots: list[torch.Tensor] = []
        num_decode = 0
        while num_decode < len(num_new) and num_new[num_decode] == 1:
            num_decode += 1
        tables = [torch.tensor(t, dtype=torch.long) for t in block_tables]
        for table, start, n in zip(tables, starts, num_new):
            pos = torch.arange(start, start + n)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        dec_tables = dec_mask = None
        if num_decode:
            max_blocks = max(len(t) for t in block_tables[:num_decode])
            dec_tables = torch.zeros(num_decode, max_blocks, dtype=torch.long)
            for i, t in enumerate(tables[:num_decode]):
                dec_tables[i, : len(t)] = t
            ctx = torch.tensor(starts[:num_decode]) + 1  # [D]
            dec_mask = (torch.arange(max_blocks * block_size)[None, :] < ctx[:, None])[:, None, None, :]
        prefills: list[PrefillSpan] = []
        q_start = num_decode
        for table, start, n in zip(tables[num_decode:], starts[num_decode:], num_new[num_decode:]):
            mask = None
            if start > 0:
                # NOTE: queries sit at positions start..start+n-1; key j is visible to query i iff j <= start + i.
                mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
            prefills.append(PrefillSpan(q_start, n, start + n, table, mask))
            q_start += n
        return AttentionMetadata(torch.cat(slots), num_decode, dec_tables, dec_mask, prefills)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) into their slots of the paged cache."""
    kvh, d = k.shape[1:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D] (this step's keys; already written to the cache)
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of every query token over its sequence's cached context."""
    out = torch.empty_like(q)
    kvh, d = k.shape[1:]
    nd = meta.num_decode
    if nd:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        bt = meta.decode_block_tables
        kd = k_cache[bt].view(nd, -1, kvh, d).transpose(1, 2)  # [D, KVH, L, D]
        vd = v_cache[bt].view(nd, -1, kvh, d).transpose(1, 2)
        qd = q[:nd].unsqueeze(2)  # [D, H, 1, D]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
        out[:nd] = o.squeeze(2)
    for span in meta.prefills:
        qs = q[span.q_start : span.q_start + span.q_len].transpose(0, 1)  # [H, n, D]
        if span.mask is None:
            ks = k[span.q_start : span.q_start + span.q_len].transpose(0, 1)  # [KVH, n, D]
            vs = v[span.q_start : span.q_start + span.q_len].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        else:
            ks = k_cache[span.block_table].view(-1, kvh, d)[: span.context_len].transpose(0, 1)
            vs = v_cache[span.block_table].view(-1, kvh, d)[: span.context_len].transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, scale=scale, enable_gqa=True)
        out[span.q_start : span.q_start + span.q_len] = o.transpose(0, 1)
    return out
