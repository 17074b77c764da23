"""Triton kernels for the decoder layer's pointwise work on the Triton backend: RMSNorm with the residual add fused
in, SiLU-and-multiply, and the rotary embedding of q and k in place with the step's KV write.

Why: a batch-1 decode step of an 8B model on an H200 spent ~0.9 ms of its ~5.3 ms graph in ~20 small torch kernels
per layer (F.rms_norm alone ~6 us a call on one row; the rotary's mul/neg/cat/mul/add), against ~3.6 ms of weight
reads; with these (one launch each) the same graph spends ~0.33 ms on them (the kernel tables of
`python -m pdcluster.bench.engine_profile --device cuda`'s code on an H200: BENCHMARKS.md, "Engine on a GPU").

Each computes what the torch ops of engine/model.py compute, rounding where they round: the residual add to the
activation dtype before the norm, SiLU's result before the multiply, each rotary product before their sum (the
rotary kernel is bit for bit the torch path's in 16-bit dtypes; compiled float32 fuses a product into its sum, an FMA
that rounds once). The norm reduces in float32 like F.rms_norm, in another order, so
it can differ from it in the last bit. Under TRITON_INTERPRET=1 (set before this module is imported) they run on
CPU tensors, which is how the tests check them.

NOTE: every rounding to bfloat16 goes through `_rounded` (round to nearest even on the bits): compiled, a cast
rounds so too, but Triton's interpreter (3.6-3.9) truncates, and the tests hold the kernels to the torch path's bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.backend import triton_interpreting

# NOTE: decided at import, as triton.jit decides: these kernels are interpreted iff TRITON_INTERPRET was on then.
INTERPRETED = triton_interpreting()


@triton.jit
def _rounded(x, dt: tl.constexpr):
    """float32 x rounded to the nearest `dt` value (ties to even), still as float32 (a later cast to dt is exact)."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dt).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, res_ptr, out_ptr, w_ptr, eps, stride_x, stride_d, stride_r, stride_o,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    """One row: res = x + delta (stored, rounded to its dtype) when HAS_DELTA, then out = norm(res) * w."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0)
        xf = _rounded(x.to(tl.float32) + d.to(tl.float32), res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + offs, xf.to(res_ptr.dtype.element_ty), mask=mask)
    else:
        xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * stride_o + offs, _rounded(xf * rstd * w, dt).to(dt), mask=mask)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, F: tl.constexpr, BLOCK: tl.constexpr):
    """Columns of one row: out = silu(x[:F]) * x[F:], SiLU rounded to the dtype first (as F.silu(g) * u)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + F + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = _rounded(g / (1.0 + tl.exp(-g)), dt)
    tl.store(out_ptr + row * stride_o + cols, _rounded(s * u, dt).to(dt), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                   stride_t, stride_h, stride_p, stride_vt, stride_vh, stride_kcb, stride_kcs, stride_kch,
                   stride_vcb, stride_vcs, stride_vch,
                   HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One token, every head of x (rotate-half): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, in place, with
    cos/sin rounded to x's dtype and each product rounded before the sum (the torch path's roundings). x's heads
    from Q_HEADS on are K: they (rotated) and V go to the token's cache slot too (a negative slot: none), the
    backend's KV write in the same launch."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    mask = (offs_h[:, None] < HEADS) & d_mask[None, :]
    dt = x_ptr.dtype.element_ty
    # NOTE: the tables are [positions, head_dim] with both halves equal (cat(freqs, freqs)): the first is read
    c = _rounded(tl.load(cos_ptr + pos * stride_p + offs_d, mask=d_mask, other=0.0), dt)[None, :]
    s = _rounded(tl.load(sin_ptr + pos * stride_p + offs_d, mask=d_mask, other=0.0), dt)[None, :]
    base = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = _rounded(_rounded(x1 * c, dt) + _rounded(-x2 * s, dt), dt).to(dt)
    o2 = _rounded(_rounded(x2 * c, dt) + _rounded(x1 * s, dt), dt).to(dt)
    tl.store(base, o1, mask=mask)
    tl.store(base + HALF, o2, mask=mask)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    kt = k_cache_ptr.dtype.element_ty
    kh = tl.maximum(offs_h - Q_HEADS, 0)
    # NOTE: the slot's sign broadcast by hand (a scalar condition in a block mask fails in the interpreter)
    k_mask = mask & (offs_h[:, None] >= Q_HEADS) & ((tl.zeros([H_PAD, HALF_PAD], tl.int64) + slot) >= 0)
    k_addr = k_cache_ptr + blk * stride_kcb + within * stride_kcs + kh[:, None] * stride_kch + offs_d[None, :]
    tl.store(k_addr, o1.to(kt), mask=k_mask)
    tl.store(k_addr + HALF, o2.to(kt), mask=k_mask)
    offs_v = tl.arange(0, KV_PAD)
    offs_f = tl.arange(0, 2 * HALF_PAD)
    v_mask = ((offs_v[:, None] < KV_HEADS) & (offs_f[None, :] < 2 * HALF)
              & ((tl.zeros([KV_PAD, 2 * HALF_PAD], tl.int64) + slot) >= 0))
    v = tl.load(v_ptr + t * stride_vt + offs_v[:, None] * stride_vh + offs_f[None, :], mask=v_mask, other=0.0)
    tl.store(v_cache_ptr + blk * stride_vcb + within * stride_vcs + offs_v[:, None] * stride_vch
             + offs_f[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(r) * weight, r) for r = x, or r = x + delta (one kernel for both); x, delta [T, d]."""
    t, n = x.shape
    out = torch.empty_like(x)
    res = x if delta is None else torch.empty_like(x)
    d = x if delta is None else delta  # NOTE: not read without a delta
    if t:
        _rms_norm_kernel[(t,)](x, d, res, out, weight, eps, x.stride(0), d.stride(0), res.stride(0), out.stride(0),
                               N=n, BLOCK=triton.next_power_of_2(n), HAS_DELTA=delta is not None)
    return out, res


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :f]) * x[:, f:] for x [T, 2f] (the fused gate/up projection's output)."""
    t, f = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, f, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(f))
    if t:
        _silu_mul_kernel[(t, triton.cdiv(f, block))](x, out, x.stride(0), out.stride(0), F=f, BLOCK=block)
    return out


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, v: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Rotate x [T, H + KVH, D] (q heads, then k; head_dim contiguous) in place by the rows `positions` of the
    [P, D] tables, and store the rotated k and v [T, KVH, D] into the caches' slots (`slot_mapping` [T] int64,
    negative: skipped), as the triton backend's write_kv does."""
    t, heads, d = x.shape
    if x.stride(-1) != 1:
        raise ValueError(f"rotary_ needs head_dim contiguous, got strides {x.stride()}")
    if not t:
        return
    kvh = v.shape[1]
    _rotary_kernel[(t,)](x, positions, cos, sin, v, k_cache, v_cache, slot_mapping, x.stride(0), x.stride(1),
                         cos.stride(0), v.stride(0), v.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
                         HEADS=heads, H_PAD=triton.next_power_of_2(heads), HALF=d // 2,
                         HALF_PAD=triton.next_power_of_2(d // 2), Q_HEADS=heads - kvh, KV_HEADS=kvh,
                         KV_PAD=triton.next_power_of_2(kvh), BLOCK_SIZE=k_cache.shape[1])
