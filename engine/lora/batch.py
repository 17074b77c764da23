"""One step's LoRA work: the batch's rows grouped per adapter, and each wrapped linear's delta added to its output.

The rows of a step are laid out sequence by sequence (engine/model_runner.py `prepare`). `LoRAStep` sorts the rows
that have an adapter into segments, one per adapter present (base rows are in none and cost nothing), once per
step; every wrapped linear then computes `y[rows] += x[rows] @ A.T @ B.T` per segment. On the CPU: segments of
about one length (a decode batch) go through one batched matmul pair over the slots' stacked weights (`bmm`, each
segment padded to the longest); others get one small matmul pair per adapter present (a loop over segments, never
over rows). With the Triton backend (CUDA): one launch of the shrink and one of the expand kernel for all segments
(engine/lora/sgmv.py).
NOTE: op count is what costs on the CPU at decode sizes (~120 wrapped linears a step in a 30-layer model): the loop
takes 2 + 2G ops per linear for G adapters, the batched path 2-7 whatever G is. Past that, the bytes of the stacks
read per step: the batched path's expand reads B.T in output chunks (engine/lora/slots.py), never the zeros of the
fused q/k/v and gate/up's block-diagonal B.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from engine.lora.adapter import LoRAAdapter

# (layer, linear) → A.T [S, in, R], B.T [S, R, out] (kernels) or [S, C, r, W] (CPU: engine/lora/slots.py)
Stacks = Callable[[int, str], tuple[torch.Tensor, torch.Tensor]]


class StepHolder(Protocol):
    """What a LoRALinear reads: the current step (engine/lora/slots.py's LoRASlots)."""

    step: LoRAStep | None


class LoRAStep:
    """The segments of one step: adapter rows sorted by adapter, with each segment's adapter and slot."""

    def __init__(self, adapters: Sequence[LoRAAdapter | None], slots: Sequence[int], counts: Sequence[int],
                 device: torch.device, stacks: Stacks, num_slots: int, kernel: bool = False,
                 chunks: dict[str, torch.Tensor | None] | None = None) -> None:
        # adapters/slots/counts: per sequence of the batch, its adapter (None: the base), slot and rows this step;
        # chunks: per linear, the part of each chunk of the CPU stacks' B.T (engine/lora/slots.py; None: one part)
        self.chunks = chunks or {}
        by_slot: dict[int, list[tuple[int, int]]] = {}
        owner: dict[int, LoRAAdapter] = {}
        start = 0
        for adapter, slot, n in zip(adapters, slots, counts):
            if adapter is not None:
                by_slot.setdefault(slot, []).append((start, start + n))
                owner[slot] = adapter
            start += n
        self.stacks = stacks
        rows: list[int] = []
        self.segments: list[tuple[int, int, LoRAAdapter]] = []  # (start, end) in the sorted rows, its adapter
        self.seg_slots: list[int] = []
        for slot, ranges in by_slot.items():
            first = len(rows)
            for a, b in ranges:
                rows.extend(range(a, b))
            self.segments.append((first, len(rows), owner[slot]))
            self.seg_slots.append(slot)
        # NOTE: when each adapter's rows already lie together in the batch (one request per adapter, a prefill),
        # the segments are slices of x and y themselves: no gather and no scatter
        self.contiguous = all(len(r) == 1 for r in by_slot.values())
        self.row_slices = [r[0] for r in by_slot.values()] if self.contiguous else []
        self.rows = torch.tensor(rows, dtype=torch.long).to(device)  # [Ta]: the batch rows, sorted by adapter
        self.max_len = max(e - s for s, e, _ in self.segments)
        self.batched: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None
        self.span: tuple[int, int] | None = None
        num = len(self.segments)
        if not kernel and num >= 2 and num * self.max_len <= 2 * len(rows):
            # (rows padded to [G * L]: padding repeats a segment's first row; its mask [G * L, 1] zeroes those,
            # or None; the slots to gather from the stacks, or None when the step uses every slot in order)
            padded, mask = [], []
            for start, end, _ in self.segments:
                padded += rows[start:end] + [rows[start]] * (self.max_len - (end - start))
                mask += [1.0] * (end - start) + [0.0] * (self.max_len - (end - start))
            pad_mask = None if all(mask) else torch.tensor(mask).unsqueeze(1)
            gather = None if self.seg_slots == list(range(num_slots)) else torch.tensor(self.seg_slots)
            self.batched = (torch.tensor(padded, dtype=torch.long), pad_mask, gather)
            # NOTE: rows already in segment order with no padding (LoRASlots.order sorts a batch so) are a slice
            # of x and y: no gather, no scatter
            if pad_mask is None and rows == list(range(rows[0], rows[0] + len(rows))):
                self.span = (rows[0], rows[0] + len(rows))
        self.device_meta: tuple[torch.Tensor, torch.Tensor] | None = None  # (segment starts [G + 1], slots [G])
        if kernel:
            starts = [s for s, _, _ in self.segments] + [len(rows)]
            self.device_meta = (torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True),
                                torch.tensor(self.seg_slots, dtype=torch.int32).to(device, non_blocking=True))

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, layer: int, linear: str) -> None:
        """y += each adapter row's x @ A.T @ B.T for this linear of this layer (x [T, in], y [T, out], in place)."""
        if self.device_meta is not None:
            from engine.lora.sgmv import add_lora

            a, b = self.stacks(layer, linear)
            add_lora(x, y, a, b, self.rows, *self.device_meta, self.max_len)
            return
        if self.batched is not None:
            self._add_batched(x, y, *self.stacks(layer, linear), self.chunks.get(linear))
            return
        if self.contiguous:
            for (start, end), (_, _, adapter) in zip(self.row_slices, self.segments):
                pair = adapter.layers[layer].get(linear)
                if pair is not None:
                    y[start:end] += torch.mm(torch.mm(x[start:end], pair.a.t()), pair.b.t())
            return
        xs = x.index_select(0, self.rows)  # [Ta, in]
        delta = y.new_zeros((xs.shape[0], y.shape[1]))  # [Ta, out]
        for start, end, adapter in self.segments:
            pair = adapter.layers[layer].get(linear)
            if pair is not None:
                torch.mm(torch.mm(xs[start:end], pair.a.t()), pair.b.t(), out=delta[start:end])
        y.index_put_((self.rows,), delta, accumulate=True)

    def _add_batched(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b_c: torch.Tensor,
                     chunks: torch.Tensor | None) -> None:
        """The CPU's batched path: a [S, P * r, in] and b_c [S, C, r, W] (the slots' stacks, B.T in output chunks
        of W columns; `chunks` [C]: each chunk's part, None for one part), one bmm pair for all segments."""
        assert self.batched is not None
        padded, mask, gather = self.batched
        if gather is not None:
            a, b_c = a.index_select(0, gather), b_c.index_select(0, gather)
        g, n, (_, c, r, w) = len(self.segments), self.max_len, b_c.shape
        span = self.span
        xs = x[span[0]:span[1]] if span is not None else x.index_select(0, padded)
        # NOTE: A @ x.T rather than x @ A.T: with a few rows per segment, MKL streams A's rows about 1.5x faster
        h_t = torch.bmm(a, xs.view(g, n, x.shape[1]).transpose(1, 2))  # [G, P * r, L]
        if span is not None and chunks is None:
            # NOTE: baddbmm_ adds into y's rows in the matmul itself: two ops per linear in a decode step
            y[span[0]:span[1]].view(g, n, w).baddbmm_(h_t.transpose(1, 2), b_c.view(g, r, w))
        elif span is not None and chunks is not None:
            y[span[0]:span[1]].view(g, n, c, w).add_(self._expand(h_t, b_c, chunks).transpose(1, 2))
        if span is not None:
            return
        if chunks is None:
            delta = torch.bmm(h_t.transpose(1, 2), b_c.view(g, r, w)).view(-1, w)  # [G * L, out]
        else:
            delta = self._expand(h_t, b_c, chunks).transpose(1, 2).reshape(g * n, c * w)
        if mask is not None:
            delta.mul_(mask)
        # NOTE: index_put_ rather than index_add_: in profiles of the LoRA bench on our shared 2-core machine,
        # index_add_ took most of the LoRA time whenever the machine was loaded; index_put_ is faster alone too
        # (4.5 against 7.1 us at [8, 960])
        y.index_put_((padded,), delta, accumulate=True)

    @staticmethod
    def _expand(h_t: torch.Tensor, b_c: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
        """Each output chunk's delta: h_t [G, P * r, L] → [G, C, L, W], chunk c from its part's r rows of h_t."""
        g, _, n = h_t.shape
        _, c, r, w = b_c.shape
        hc = h_t.view(g * c, r, n) if h_t.shape[1] == c * r else \
            h_t.view(g, -1, r, n).index_select(1, chunks).view(g * c, r, n)  # [G * C, r, L]; a chunk per part: a view
        return torch.bmm(hc.transpose(1, 2), b_c.view(g * c, r, w)).view(g, c, n, w)


class LoRALinear:
    """A base linear layer with the step's adapter deltas added to its output (the base's result untouched when the
    step has no adapter rows)."""

    def __init__(self, base: object, pool: StepHolder, layer: int, linear: str) -> None:
        self.base, self.pool, self.layer, self.linear = base, pool, layer, linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] → [T, out]
        y = self.base(x)  # type: ignore[operator]
        step = self.pool.step
        if step is not None:
            step.add_delta(x, y, self.layer, self.linear)
        return y

    def __getattr__(self, name: str) -> object:  # the base's attributes (out_features, plain_weight, ...)
        return getattr(self.base, name)
