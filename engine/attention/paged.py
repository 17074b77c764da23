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
Prefill chunks that start their sequence attend their own new K/V with SDPA in both: one fused (flash) SDPA call
per chunk with GQA (`prefill="flash"`, the default), or the older 128-row chunks through SDPA's math path
(`prefill="chunked"`, kept as the measured baseline of `pdcluster bench engine`).
Everything that depends only on the batch (slots, plans, padded block tables, masks) is built on the host once per
step in `AttentionMetadata`, moved to the device with one copy (engine/attention/pack.py) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch
import torch.nn.functional as F

from engine.attention import triton_backend
from engine.attention.backend import RESOLVED, select_backend
from engine.attention.inplace import KernelPlan, build_plan, in_place
from engine.attention.pack import Packed, pack
from engine.attention.triton_backend import TritonMetadata, build_triton
from engine.kernels import attention_kernel
from engine.kv_quant import gather_dequantized, write_quantized

# NOTE: prefill="chunked" processes queries in chunks of this many rows (a boolean mask per chunk), which sends SDPA
# down its math path (the broadcast GQA and the mask). prefill="flash" makes one SDPA call per prefill chunk with
# enable_gqa and is_causal (or one boolean mask over its cached context), which torch's CPU flash kernel takes:
# 1.5x faster on a 1,000-token prompt and ~5x on 32 rows over 900 cached tokens, per layer, on one core.
PREFILL_CHUNK = 128
PREFILL_MODES = ("flash", "chunked")


@dataclass
class PrefillSpan:
    """A chunk of `q_len` query tokens of one sequence, starting at flat index `q_start`."""

    q_start: int
    q_len: int
    context_len: int  # tokens with KV after this step (cached prefix + this chunk)
    block_table: torch.Tensor  # [num_blocks] long
    has_context: bool  # False when the chunk starts the sequence (its own K/V are all it attends to)
    # chunked: per query chunk of PREFILL_CHUNK rows, [rows, keys up to its horizon] bool; flash: one
    # [q_len, context_len] bool mask for a chunk with context, none without (is_causal); none when in_plan
    masks: list[torch.Tensor]
    in_plan: bool = False  # attended by the kernel's plan (then `masks` is empty)
    flash: bool = True  # one fused SDPA call (prefill="flash") rather than PREFILL_CHUNK-row chunks


@dataclass
class DecodeGroup:
    """Decode entries of similar context length, attended in one padded call."""

    rows: torch.Tensor  # [n] long: their indices in the flat batch
    block_tables: torch.Tensor  # [n, max_blocks] long, padded with block 0
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool: True = attend


@dataclass
class AttentionMetadata:
    """Per-step layout of the flat token batch: `num_decode` single-token entries, then prefill spans."""

    slot_mapping: torch.Tensor  # [T] long: block_id * block_size + offset, where each new token's K/V goes
    num_decode: int
    decode_groups: list[DecodeGroup]  # gather path only
    prefills: list[PrefillSpan]
    plan: KernelPlan | None = None  # kernel path: every decode entry and prefill chunk with context
    backend: str = "gather"  # "kernel", "gather" or "triton" (engine/attention/backend.py)
    triton: TritonMetadata | None = None  # triton path only
    packed: Packed | None = None  # the one buffer the device tensors above view (None: CPU gather/kernel paths)

    @staticmethod
    def build(
        block_tables: list[list[int]], starts: list[int], num_new: list[int], block_size: int,
        kernel: ModuleType | None | Literal["auto"] = "auto", cascade: bool = True,
        prefill: Literal["flash", "chunked"] = "flash", *, device: torch.device | str = "cpu",
        backend: str | None = None, pad_rows: int = 0, pad_blocks: int = 0, pad_block: int = 0,
        out: AttentionMetadata | None = None,
    ) -> AttentionMetadata:
        """Lay out a step: sequence i computes tokens [starts[i], starts[i] + num_new[i]) (decode entries first).

        `backend`: "kernel", "gather" or "triton"; None: "kernel" when `kernel` is a module, "gather" when it is
        None, select_backend(device) when "auto". `kernel`: the compiled kernel module for the kernel path ("auto":
        whatever engine/kernels.py provides). `cascade`: attend shared prefixes of decode entries once per group
        (kernel path). `prefill`: how prefill chunks the plan does not cover run SDPA (PREFILL_MODES). `device`:
        where the layers run; the metadata is built on the host and copied there once.
        Triton only (CUDA graphs, see engine/attention/__init__.py): `pad_rows` pads a decode-only batch to that
        many rows and `pad_blocks` its block tables to that many columns, padding with block `pad_block`; `out`
        copies the result into that preallocated metadata of the same shapes and returns it.
        """
        dev = torch.device(device)
        if backend is None:
            backend = select_backend(dev) if kernel == "auto" else "gather" if kernel is None else "kernel"
        if backend not in RESOLVED:
            raise ValueError(f"attention backend must be one of {RESOLVED}, got {backend!r}")
        if backend == "kernel" and kernel in ("auto", None):
            kernel = attention_kernel()
            if kernel is None:
                raise RuntimeError("attention backend 'kernel' but the kernels are not built")
        if backend == "kernel" and dev.type != "cpu":
            raise ValueError(f"the compiled attention kernel runs on the CPU, not on {dev}")
        num_decode = 0
        while num_decode < len(num_new) and num_new[num_decode] == 1:
            num_decode += 1
        if (pad_rows > num_decode or out is not None) and (backend != "triton" or num_decode < len(num_new)):
            raise ValueError("pad_rows / out: only for decode-only batches on the triton backend (CUDA graphs)")
        slots = _slots(block_tables, starts, num_new, block_size)
        if pad_rows > num_decode:  # NOTE: padded rows write their (unused) K/V into block `pad_block`'s first slot
            slots = torch.cat([slots, torch.full((pad_rows - num_decode,), pad_block * block_size, dtype=torch.long)])
        if backend == "triton":
            tmeta = build_triton(block_tables, starts, num_new, num_decode, block_size, pad_rows, pad_blocks,
                                 pad_block)
            spans = _spans(block_tables, starts, num_new, num_decode, prefill, None, masks=False)
            meta = AttentionMetadata(slots, max(num_decode, pad_rows), [], spans, None, backend, tmeta)
            return meta._to(dev, out)
        plan = None
        groups: list[DecodeGroup] = []
        if backend == "kernel":
            assert isinstance(kernel, ModuleType)
            plan = build_plan(kernel, block_tables, starts, num_new, num_decode, block_size, cascade,
                              prefill == "flash")
        else:
            tables = [torch.tensor(t, dtype=torch.long) for t in block_tables[:num_decode]]
            groups = _decode_groups(tables, starts[:num_decode], block_size)
        spans = _spans(block_tables, starts, num_new, num_decode, prefill, plan, masks=True)
        meta = AttentionMetadata(slots, num_decode, groups, spans, plan, backend)
        return meta if dev.type == "cpu" else meta._to(dev, None)

    def _fields(self) -> list[torch.Tensor]:
        """Every tensor of the metadata, in one fixed order (packing and copying)."""
        ts = [self.slot_mapping]
        for g in self.decode_groups:
            ts += [g.rows, g.block_tables, g.mask]
        for s in self.prefills:
            ts += [s.block_table, *s.masks]
        return ts + (self.triton.tensors() if self.triton is not None else [])

    def _to(self, device: torch.device, out: AttentionMetadata | None) -> AttentionMetadata:
        """This metadata with its tensors on `device` (one copy), or copied into `out`."""
        if out is not None:
            out.copy_from(self)
            return out
        packed = pack(self._fields(), device)
        it = iter(packed.tensors)
        self.slot_mapping = next(it)
        for g in self.decode_groups:
            g.rows, g.block_tables, g.mask = next(it), next(it), next(it)
        for s in self.prefills:
            s.block_table = next(it)
            s.masks = [next(it) for _ in s.masks]
        if self.triton is not None:
            self.triton = self.triton.with_tensors(list(it))
        self.packed = packed
        return self

    def copy_from(self, other: AttentionMetadata) -> None:
        """Copy `other`'s tensors into this metadata's (a static one a CUDA graph reads): one non-blocking copy of
        the packed buffer (from `other`'s pinned host pack when it has one). The shapes must be equal."""
        if self.packed is None:
            raise ValueError("copy_from: this metadata has no packed buffer (built for the CPU gather/kernel path)")
        layout = [(tuple(t.shape), t.dtype) for t in other._fields()]
        if layout != self.packed.layout or other.num_decode != self.num_decode or other.prefills or self.prefills:
            raise ValueError(f"copy_from: shapes differ (static {self.packed.layout}, this step {layout}); pad the "
                             "step to the static metadata's rows and block-table width (pad_rows, pad_blocks)")
        src = other.packed.host if other.packed is not None else pack(other._fields(), torch.device("cpu"),
                                                                     pin=self.packed.buffer.is_cuda).host
        self.packed.buffer.copy_(src, non_blocking=True)


def _slots(block_tables: list[list[int]], starts: list[int], num_new: list[int], block_size: int) -> torch.Tensor:
    """[T] long: the cache slot of every new token."""
    slots = [torch.empty(0, dtype=torch.long)]
    for table, start, n in zip(block_tables, starts, num_new):
        pos = torch.arange(start, start + n)
        slots.append(torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size)
    return torch.cat(slots)


def _spans(block_tables: list[list[int]], starts: list[int], num_new: list[int], num_decode: int, prefill: str,
           plan: KernelPlan | None, masks: bool) -> list[PrefillSpan]:
    """The prefill chunks (with their SDPA masks when `masks` and the kernel's plan does not cover them)."""
    spans: list[PrefillSpan] = []
    q_start = num_decode
    for table, start, n in zip(block_tables[num_decode:], starts[num_decode:], num_new[num_decode:]):
        # NOTE: SDPA masks only for the chunks the kernel's plan does not cover.
        flash = prefill == "flash"
        planned = plan is not None and in_place(start, n, flash)
        m = [] if planned or not masks else _flash_mask(start, n) if flash else _chunk_masks(start, n)
        spans.append(PrefillSpan(q_start, n, start + n, torch.tensor(table, dtype=torch.long), start > 0, m, planned,
                                 flash))
        q_start += n
    return spans


# NOTE: a padded decode call costs (entries x longest context); one 1,500-token context among short ones would
# make every entry pay for 1,500 keys. Entries are grouped so no group pads to more than this x its shortest.
DECODE_PAD_RATIO = 2.0


def _decode_groups(tables: list[torch.Tensor], starts: list[int], block_size: int) -> list[DecodeGroup]:
    """Decode entries sorted by context and cut into groups whose padding stays within DECODE_PAD_RATIO."""
    order = sorted(range(len(tables)), key=lambda i: len(tables[i]))
    cuts: list[list[int]] = []
    for i in order:
        if cuts and len(tables[i]) <= DECODE_PAD_RATIO * len(tables[cuts[-1][0]]):
            cuts[-1].append(i)
        else:
            cuts.append([i])
    groups = []
    for idx in cuts:
        max_blocks = len(tables[idx[-1]])
        bt = torch.zeros(len(idx), max_blocks, dtype=torch.long)
        for row, i in enumerate(idx):
            bt[row, : len(tables[i])] = tables[i]
        ctx = torch.tensor([starts[i] + 1 for i in idx])  # [n]
        mask = (torch.arange(max_blocks * block_size)[None, :] < ctx[:, None])[:, None, None, :]
        groups.append(DecodeGroup(torch.tensor(idx, dtype=torch.long), bt, mask))
    return groups


def _chunk_masks(start: int, n: int) -> list[torch.Tensor]:
    """Causal masks of the query chunks of positions start..start+n-1 (key j visible to query i iff j <= i)."""
    masks = []
    for c in range(0, n, PREFILL_CHUNK):
        horizon = start + min(c + PREFILL_CHUNK, n)
        masks.append(torch.arange(horizon)[None, :] <= torch.arange(start + c, horizon)[:, None])
    return masks


def _flash_mask(start: int, n: int) -> list[torch.Tensor]:
    """prefill="flash": no mask for a chunk that starts its sequence (is_causal), else one [n, start + n] bool."""
    if start == 0:
        return []
    return [torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]]


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
