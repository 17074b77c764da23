"""Triton kernels for a step's LoRA deltas on CUDA, in the style of Punica's SGMV (S-LoRA's batched LoRA): the rows
of a step sorted into one segment per adapter, and two launches per linear for all segments: shrink
(h = x[rows] @ A[slot].T, [Ta, R] in float32) and expand (y[rows] += h @ B[slot].T).

The weights are the slots' stacks (engine/lora/slots.py: A.T [S, in, R], B.T [S, R, out], zeros past a rank),
so a program finds its adapter by the segment's slot; base rows are in no segment and are never read. The rows
are gathered and scattered by index inside the kernels (no copy of x or y). Each row lies in one segment, so the
expand's read-add-write of y has no race.
Under TRITON_INTERPRET=1 (set before this module is imported) they run on CPU tensors, which is how
tests/test_lora_sgmv.py checks them against the torch path (engine/lora/batch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.backend import triton_interpreting

# NOTE: decided at import, as triton.jit decides: these kernels are interpreted iff TRITON_INTERPRET was on then.
INTERPRETED = triton_interpreting()
BLOCK_M = 16  # rows of a segment per program (tl.dot's least size)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, rows_ptr, seg_ptr, slot_ptr, stride_x, stride_as, stride_ak, stride_h, K,
                   R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [mb * BLOCK_M, +BLOCK_M) of segment g: h[m] = x[rows[m]] @ A[slot].T, accumulated in float32."""
    g = tl.program_id(0)
    start, end = tl.load(seg_ptr + g), tl.load(seg_ptr + g + 1)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    rows = tl.load(rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + g).to(tl.int64)
    offs_r = tl.arange(0, R)
    acc = tl.zeros((BLOCK_M, R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_ptr + slot * stride_as + offs_k[:, None] * stride_ak + offs_r[None, :], mask=k_mask[:, None],
                    other=0.0).to(tl.float32)  # [BLOCK_K, R]
        acc += tl.dot(x, a, input_precision="ieee")
    tl.store(h_ptr + offs_m[:, None] * stride_h + offs_r[None, :], acc, mask=m_mask[:, None])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, rows_ptr, seg_ptr, slot_ptr, stride_h, stride_bs, stride_br, stride_y, N,
                   R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Columns [nb * BLOCK_N, +BLOCK_N) of those rows: y[rows[m]] += h[m] @ B[slot].T (added in float32)."""
    g = tl.program_id(0)
    start, end = tl.load(seg_ptr + g), tl.load(seg_ptr + g + 1)
    offs_m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    rows = tl.load(rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    slot = tl.load(slot_ptr + g).to(tl.int64)
    offs_r = tl.arange(0, R)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    h = tl.load(h_ptr + offs_m[:, None] * stride_h + offs_r[None, :], mask=m_mask[:, None], other=0.0)  # [BM, R]
    b = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :], mask=n_mask[None, :],
                other=0.0).to(tl.float32)  # [R, BLOCK_N]
    delta = tl.dot(h, b, input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    mask = m_mask[:, None] & n_mask[None, :]
    ptrs = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def add_lora(x: torch.Tensor, y: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor, rows: torch.Tensor,
             seg_starts: torch.Tensor, seg_slots: torch.Tensor, max_len: int) -> None:
    """y[rows] += x[rows] @ A[slot].T @ B[slot].T per segment, in place.

    x [T, in], y [T, out] (rows contiguous); a_t [S, in, R], b_t [S, R, out] (R a power of two >= 16); rows [Ta]
    int64 (the batch rows sorted by adapter); seg_starts [G + 1] and seg_slots [G] int32; max_len: the longest segment
    (known on the host: the grid's size, no sync).
    """
    assert x.stride(1) == 1 and y.stride(1) == 1 and a_t.is_contiguous() and b_t.is_contiguous()
    num_segments, r = seg_slots.shape[0], a_t.shape[2]
    k, n = x.shape[1], y.shape[1]
    h = torch.empty(rows.shape[0], r, dtype=torch.float32, device=x.device)  # [Ta, R]
    blocks = triton.cdiv(max_len, BLOCK_M)
    _shrink_kernel[(num_segments, blocks)](x, a_t, h, rows, seg_starts, seg_slots, x.stride(0), a_t.stride(0),
                                           a_t.stride(1), h.stride(0), k, R=r, BLOCK_M=BLOCK_M, BLOCK_K=64)
    block_n = 64
    _expand_kernel[(num_segments, blocks, triton.cdiv(n, block_n))](
        h, b_t, y, rows, seg_starts, seg_slots, h.stride(0), b_t.stride(0), b_t.stride(1), y.stride(0), n, R=r,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n)
