"""The per-step layout of attention: `AttentionMetadata` (the flat batch's decode entries and prefill spans, plus
what the chosen backend reads: the compiled kernel's plan, the gather path's decode groups and masks, the Triton
metadata), built on the host once per step and moved to the device with one copy (engine/attention/pack.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch

from engine.attention.backend import RESOLVED, select_backend
from engine.attention.inplace import KernelPlan, build_plan, in_place
from engine.attention.pack import Packed, pack
from engine.attention.triton_backend import TritonMetadata, build_triton
from engine.kernels import attention_kernel

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


def slot_of(table: list[int], position: int, block_size: int) -> int:
    """The cache slot (block_id * block_size + offset) of `position` in a sequence with block table `table`."""
    return table[position // block_size] * block_size + position % block_size


def _slots(block_tables: list[list[int]], starts: list[int], num_new: list[int], block_size: int) -> torch.Tensor:
    """[T] long: the cache slot of every new token.

    NOTE: a single-token (decode) entry's slot is int arithmetic on the host: tensor ops per entry cost ~12 us each,
    0.8 ms a step for a batch of 64; only chunks of several tokens take the tensor path.
    """
    parts: list[torch.Tensor] = []
    singles: list[int] = []  # slots of the single-token entries since the last chunk
    for table, start, n in zip(block_tables, starts, num_new):
        if n == 1:
            singles.append(slot_of(table, start, block_size))
            continue
        if singles:
            parts.append(torch.tensor(singles, dtype=torch.long))
            singles = []
        pos = torch.arange(start, start + n)
        parts.append(torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size)
    parts.append(torch.tensor(singles, dtype=torch.long))
    return torch.cat(parts)


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
