"""One step's LoRA work: the batch's rows grouped per adapter, and each wrapped linear's delta added to its output.

The rows of a step are laid out sequence by sequence (engine/model_runner.py `prepare`). `LoRAStep` sorts the rows
that have an adapter into segments, one per adapter present (base rows are in none and cost nothing), once per
step; every wrapped linear then computes `y[rows] += x[rows] @ A.T @ B.T` per segment. On the CPU: segments of
about one length (a decode batch) go through one batched matmul pair over the slots' stacked weights (`bmm`, each
segment padded to the longest); others get one small matmul pair per adapter present (a loop over segments, never
over rows). With the Triton backend (CUDA): one launch of the shrink and one of the expand kernel for all segments
(engine/lora/sgmv.py).
NOTE: op count is what costs on the CPU at decode sizes (~120 wrapped linears a step in a 30-layer model): the loop
takes 2 + 2G ops per linear for G adapters, the batched path 2-7 whatever G is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from engine.lora.adapter import LoRAAdapter

Stacks = Callable[[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, linear) → A.T [S, in, R], B.T [S, R, out]


class StepHolder(Protocol):
    """What a LoRALinear reads: the current step (engine/lora/slots.py's LoRASlots)."""

    step: LoRAStep | None


class LoRAStep:
    """The segments of one step: adapter rows sorted by adapter, with each segment's adapter and slot."""

    def __init__(self, adapters: Sequence[LoRAAdapter | None], slots: Sequence[int], counts: Sequence[int],
                 device: torch.device, stacks: Stacks, num_slots: int, kernel: bool = False) -> None:
        # adapters/slots/counts: per sequence of the batch, its adapter (None: the base), slot and rows this step
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
            self._add_batched(x, y, *self.stacks(layer, linear))
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

    def _add_batched(self, x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor) -> None:
        """The CPU's batched path: a_t [S, in, R] and b_t [S, R, out] (the slots' stacks), one bmm pair for all."""
        assert self.batched is not None
        padded, mask, gather = self.batched
        if gather is not None:
            a_t, b_t = a_t.index_select(0, gather), b_t.index_select(0, gather)
        shape = (len(self.segments), self.max_len, x.shape[1])
        if self.span is not None:
            start, end = self.span
            # NOTE: baddbmm_ adds into y's rows in the matmul itself: two ops per linear in a decode step
            y[start:end].view(shape[0], shape[1], y.shape[1]).baddbmm_(torch.bmm(x[start:end].view(shape), a_t), b_t)
            return
        xs = x.index_select(0, padded).view(shape)  # [G, L, in]
        delta = torch.bmm(torch.bmm(xs, a_t), b_t).view(-1, y.shape[1])  # [G * L, out]
        if mask is not None:
            delta.mul_(mask)
        # NOTE: index_put_ rather than index_add_: in profiles of the LoRA bench on our shared 2-core machine,
        # index_add_ took most of the LoRA time whenever the machine was loaded; index_put_ is faster alone too
        # (4.5 against 7.1 us at [8, 960])
        y.index_put_((padded,), delta, accumulate=True)


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
