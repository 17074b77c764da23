"""Attention over paged KV blocks, for a flat batch of decode tokens and variable-length prefill chunks.

`paged_attention` is the one kernel seam. Three backends behind it (engine.attention.select_backend picks one):
- the compiled kernel (engine/csrc/, planned by engine/attention/inplace.py): reads K/V in place from the paged
  cache for decode and for short prefill chunks with cached context (long ones: gather + SDPA), and attends
  prefixes that several decode entries share once for all of them (cascade, engine/attention/cascade.py). It
  handles float32/bf16/fp16 and int8 caches.
- the pure-torch gather path (this module): gathers each sequence's blocks into fresh tensors, then SDPA, on any
  device. Used when the kernel is not built or `PDCLUSTER_ATTENTION=gather` (engine/kernels.py).
- the Triton kernels (engine/attention/triton_backend.py): paged decode with split-KV, varlen prefill over a cached
  context, the KV write; the default on CUDA.
Prefill chunks that start their sequence attend their own new K/V with SDPA (the Triton backend: only long ones):
one fused (flash) SDPA call per chunk with GQA (`prefill="flash"`, the default), or the older 128-row chunks through
SDPA's math path (`prefill="chunked"`, kept as the measured baseline of `pdcluster bench engine`).
Everything that depends only on the batch (slots, plans, padded block tables, masks) is built on the host once per
step in `AttentionMetadata` (engine/attention/metadata.py), moved to the device with one copy and shared by all
layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention import triton_backend
from engine.attention.metadata import PREFILL_CHUNK, AttentionMetadata, PrefillSpan
from engine.kv_quant import gather_dequantized, write_quantized


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: list[torch.Tensor],
           scale: float) -> torch.Tensor:
    """One fused SDPA call with GQA; q [n, H, D], k/v [L, KVH, D] → [n, H, D] (causal, or `masks[0]`)."""
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, heads, n|L, D]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=masks[0] if masks else None, is_causal=not masks,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor | AttentionMetadata) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) into their slots of the paged cache.

    `slots`: the step's metadata (its backend's write: a Triton kernel on the triton backend) or its slot mapping.
    """
    if isinstance(slots, AttentionMetadata):
        if slots.backend == "triton":
            triton_backend.write(k_cache, v_cache, k, v, slots.slot_mapping)
            return
        slots = slots.slot_mapping
    slot_mapping = slots
    if k_cache.dtype == torch.int8:
        write_quantized(k_cache, k, slot_mapping)
        write_quantized(v_cache, v, slot_mapping)
        return
    kvh, d = k.shape[1:]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def _causal_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, masks: list[torch.Tensor],
                   scale: float) -> torch.Tensor:
    """Causal attention chunk by chunk; q [H, n, D], k/v [KVH, L, D] → [H, n, D]."""
    h, n, d = q.shape
    kvh = k.shape[0]
    qg = q.view(kvh, h // kvh, n, d)  # GQA: query heads grouped under their KV head
    kb, vb = k.unsqueeze(1), v.unsqueeze(1)  # [KVH, 1, L, D], broadcast over the group
    out = torch.empty(kvh, h // kvh, n, d, dtype=q.dtype, device=q.device)
    for i, mask in enumerate(masks):
        c, horizon = i * PREFILL_CHUNK, mask.shape[1]
        rows = slice(c, c + mask.shape[0])
        out[:, :, rows] = F.scaled_dot_product_attention(
            qg[:, :, rows], kb[:, :, :horizon], vb[:, :, :horizon], attn_mask=mask, scale=scale)
    return out.view(h, n, d)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks of a paged cache, [n, block_size, KVH, D]; an int8 cache is dequantized as it is read."""
    if cache.dtype == torch.int8:
        return gather_dequantized(cache, block_ids, dtype)
    return cache.index_select(0, block_ids)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D] (this step's keys; already written to the cache)
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] (int8: [num_blocks, block_size + 1, KVH, D])
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of every query token over its sequence's cached context."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.triton is not None:
        triton_backend.attend(q, k, v, k_cache, v_cache, meta.triton, scale, out)
        return out
    h = q.shape[1]
    kvh, d = k.shape[1:]
    if meta.plan is not None:
        meta.plan.run(q, k_cache, v_cache, scale, out)
    for span in meta.prefills:
        if span.in_plan:
            continue
        if not span.has_context:
            _prefill_own(q, k, v, span, scale, out)
            continue
        rows = slice(span.q_start, span.q_start + span.q_len)
        ks = _gather(k_cache, span.block_table, q.dtype).view(-1, kvh, d)[: span.context_len]
        vs = _gather(v_cache, span.block_table, q.dtype).view(-1, kvh, d)[: span.context_len]
        if span.flash:
            out[rows] = _flash(q[rows], ks, vs, span.masks, scale)
            continue
        o = _causal_chunks(q[rows].transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), span.masks, scale)
        out[rows] = o.transpose(0, 1)
    for g in meta.decode_groups:  # gather path only (the plan holds the kernel's decode entries)
        n = len(g.rows)
        bt = g.block_tables.view(-1)
        # NOTE: index_select on the flat block axis is 5x faster than advanced indexing k_cache[tables] here.
        kd = _gather(k_cache, bt, q.dtype).view(n, -1, kvh, d).transpose(1, 2)  # [n, KVH, L, D]
        vd = _gather(v_cache, bt, q.dtype).view(n, -1, kvh, d).transpose(1, 2)
        # NOTE: one query per sequence, so a KV head's query group can stand in the query-length dimension.
        qd = q.index_select(0, g.rows).view(n, kvh, h // kvh, d)  # [n, KVH, G, D]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
        out.index_copy_(0, g.rows, o.reshape(n, h, d))
    return out


def _prefill_own(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, span: PrefillSpan, scale: float,
                 out: torch.Tensor) -> None:
    """A chunk that starts its sequence: causal attention over its own new K/V (no cache read)."""
    rows = slice(span.q_start, span.q_start + span.q_len)
    if span.flash:
        out[rows] = _flash(q[rows], k[rows], v[rows], span.masks, scale)
        return
    o = _causal_chunks(q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1), span.masks, scale)
    out[rows] = o.transpose(0, 1)
