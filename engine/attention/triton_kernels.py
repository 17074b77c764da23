"""Triton kernels for paged attention: split-KV decode (+ its log-sum-exp merge), varlen prefill over a cached
context, and the KV write from a slot mapping.

Caches are [num_blocks, block_size, KVH, D] (head_dim contiguous); a token at position p of a sequence lives in
block `table[p // block_size]`, row `p % block_size`. Every load is masked (no out-of-bounds address is read: the
interpreter segfaults on one), accumulation is float32, and every `tl.dot` tile is >= 16 in each dimension (the
GQA group and head_dim are padded to 16 with masks), as a GPU requires.
Loop bounds come from loaded lengths (scf.for on a GPU; the interpreter of triton >= 3.9 takes them too, 3.6's
fails with numpy >= 2.4, which is why the dev dependency is 3.9). Under the interpreter (TRITON_INTERPRET=1 when
this module is imported) `UPCAST` turns tiles to float32 before `tl.dot`, whose bf16 path there multiplies the raw
bits; compiled, bf16 tiles go to the tensor cores as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.backend import triton_interpreting

# NOTE: decided at import, as triton.jit decides: these kernels are interpreted iff TRITON_INTERPRET was on then.
INTERPRETED = triton_interpreting()
FP32_PRECISION = "ieee"  # float32 dots: exact fp32 products (a GPU's default would be tf32); "tf32" for speed
DECODE_BLOCK_N = 64  # keys per decode tile
# tile rows per prefill program (query tokens x their GQA group), keys per tile: 64 x 64 for 16-bit tiles; float32
# tiles take twice the shared memory per element, so 32 x 32 keeps the pipelined K/V tiles well inside an H100's
# 227 KiB per block
PREFILL_TILES = {torch.float32: (32, 32)}
PREFILL_TILES_16BIT = (64, 64)


def prefill_tiles(dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the prefill kernel for q/K/V of `dtype`."""
    return PREFILL_TILES.get(dtype, PREFILL_TILES_16BIT)


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, offs_n, n_mask, kvh, offs_d, d_mask,
             stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
             BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """The K and V tiles ([BLOCK_N, D_PAD] each) of keys `offs_n` of one KV head, read through the block table row
    at `table_ptr`; masked keys read as 0."""
    blk = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    within = offs_n % BLOCK_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + blk[:, None] * stride_kb + within[:, None] * stride_ks + kvh * stride_kh
                + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + blk[:, None] * stride_vb + within[:, None] * stride_vs + kvh * stride_vh
                + offs_d[None, :], mask=kv_mask, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _online_softmax_step(q, k, v, valid, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """One K/V tile into the running max `m_i`, sum `l_i` and output `acc` of q's rows; keys where `valid` (broadcast
    to [rows, BLOCK_N]) is false get no weight. The caller sees to it that m_i is finite after the first tile."""
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [rows, BLOCK_N]
    qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One decode row x one KV head (its GQA group of query heads as the tile's rows) x one key range: the row's
    keys cut into NUM_SPLITS ranges of whole BLOCK_N tiles by its own length (the tail ranges of a short row are
    empty), so a row of 512 keys is attended by 8 programs per head whatever the block tables' width."""
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP_PAD, D_PAD]
    if UPCAST:
        q = q.to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + row)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + row * stride_bt, offs_n, n_mask, kvh, offs_d,
                        d_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE,
                        UPCAST)  # [BLOCK_N, D_PAD] each
        # NOTE: every tile has a valid key, so m_i is finite after it
        m_i, l_i, acc = _online_softmax_step(q, k, v, n_mask[None, :], m_i, l_i, acc, scale, PRECISION)
    has = l_i > 0.0  # an empty range (a row shorter than this split's start) leaves lse -inf: weight 0 in the merge
    safe_l = tl.where(has, l_i, 1.0)
    lse = tl.where(has, m_i + tl.log(safe_l), float("-inf"))
    o = acc / safe_l[:, None]
    # NOTE: an empty range stores only its lse (the merge reads no partial result behind a -inf)
    tl.store(mid_o_ptr + row * stride_mot + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :], o,
             mask=g_mask[:, None] & d_mask[None, :] & has[:, None])
    tl.store(mid_lse_ptr + row * stride_mlt + heads * stride_mlh + split, lse, mask=g_mask)


@triton.jit
def _merge_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, stride_mot, stride_moh, stride_mos, stride_mlt, stride_mlh, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    """One decode row x one query head: the split results weighted by exp(lse_s - max lse)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + row * stride_mlt + head * stride_mlh + offs_s, mask=s_mask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    filled = s_mask & (lse > float("-inf"))
    o = tl.load(mid_o_ptr + row * stride_mot + head * stride_moh + offs_s[:, None] * stride_mos + offs_d[None, :],
                mask=filled[:, None] & d_mask[None, :], other=0.0)  # [S_PAD, D_PAD]
    res = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, q_start_ptr, q_lens_ptr, ctx_lens_ptr, block_tables_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """BLOCK_Q query tokens of one prefill chunk x one KV head's GQA group (tile row i: token i // GROUP, query head
    i % GROUP, BLOCK_Q * GROUP <= BLOCK_M rows), over the chunk's cached context and itself (the chunk's K/V are
    already in the cache), causal: the query at position p sees keys 0..p. Each K/V tile is read once per group."""
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    qb = tl.program_id(2)
    q0 = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_lens_ptr + seq)
    ctx_len = tl.load(ctx_lens_ptr + seq)
    first_pos = ctx_len - q_len  # position of the chunk's first query
    offs_i = tl.arange(0, BLOCK_M)
    tok = qb * BLOCK_Q + offs_i // GROUP  # [BLOCK_M]: the query token of each tile row
    heads = kvh * GROUP + offs_i % GROUP
    offs_d = tl.arange(0, D_PAD)
    m_mask = (offs_i < BLOCK_Q * GROUP) & (tok < q_len)
    d_mask = offs_d < HEAD_DIM
    rows = (q0 + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, D_PAD]
    if UPCAST:
        q = q.to(tl.float32)
    pos = first_pos + tok
    # NOTE: the last token of this tile sees up to first_pos + (qb + 1) * BLOCK_Q - 1; a tile past the chunk reads none
    kv_end = tl.where(qb * BLOCK_Q < q_len, tl.minimum(ctx_len, first_pos + (qb + 1) * BLOCK_Q), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, offs_n, n_mask, kvh, offs_d,
                        d_mask, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE,
                        UPCAST)  # [BLOCK_N, D_PAD] each
        # NOTE: key 0 is in the first tile and visible to every row (padded ones too), so m_i is finite after it
        causal = (offs_n[None, :] <= pos[:, None]) & n_mask[None, :]  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = _online_softmax_step(q, k, v, causal, m_i, l_i, acc, scale, PRECISION)
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One token: its K and V (every KV head) into the cache slot the slot mapping names (a negative slot: none)."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    within = slot % BLOCK_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    slots = tl.zeros([H_PAD, D_PAD], tl.int64) + slot
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & (slots >= 0)
    k = tl.load(k_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask, other=0.0)
    tl.store(k_cache_ptr + blk * stride_kcb + within * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk * stride_vcb + within * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _pad(n: int) -> int:
    """A tile extent for n: a power of two, >= 16 (tl.dot's smallest tile on a GPU)."""
    return max(16, triton.next_power_of_2(n))


def _check(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"triton attention needs head_dim contiguous, got strides {t.stride()}")
        if t.device.type == "cpu" and not INTERPRETED:
            raise RuntimeError("triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                               "engine.attention.triton_kernels is imported")


def _precision(dtype: torch.dtype, precision: str | None) -> str:
    return precision or (FP32_PRECISION if dtype == torch.float32 else "tf32")


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, num_splits: int, scale: float, out: torch.Tensor,
           precision: str | None = None) -> None:
    """Attention of decode rows 0..B-1 of q ([T, H, D]) over their paged context into out's rows; B = len(seq_lens),
    block_tables [B, W] int32. Every row's keys are cut into `num_splits` ranges (programs), merged by lse."""
    _check(q, k_cache, v_cache, out)
    b, (h, d), kvh = seq_lens.shape[0], q.shape[1:], k_cache.shape[2]
    block_size = k_cache.shape[1]
    mid_o = torch.empty(b, h, num_splits, d, dtype=torch.float32, device=q.device)  # [B, H, S, D]
    mid_lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=q.device)  # [B, H, S]
    group = h // kvh
    _decode_kernel[(b, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse, scale,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        *mid_o.stride()[:3], *mid_lse.stride()[:2],
        GROUP=group, GROUP_PAD=_pad(group), HEAD_DIM=d, D_PAD=_pad(d), BLOCK_SIZE=block_size,
        BLOCK_N=DECODE_BLOCK_N, NUM_SPLITS=num_splits, UPCAST=INTERPRETED, PRECISION=_precision(q.dtype, precision))
    _merge_kernel[(b, h)](
        mid_o, mid_lse, out, *mid_o.stride()[:3], *mid_lse.stride()[:2], out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, S_PAD=max(2, triton.next_power_of_2(num_splits)), HEAD_DIM=d, D_PAD=_pad(d))


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
            q_lens: torch.Tensor, ctx_lens: torch.Tensor, block_tables: torch.Tensor, max_q_len: int, scale: float,
            out: torch.Tensor, precision: str | None = None) -> None:
    """Causal attention of P prefill chunks (chunk i: q rows q_start[i].. + q_lens[i], positions ctx_lens[i] -
    q_lens[i]..) over their paged context (block_tables [P, W] int32) into out's rows."""
    _check(q, k_cache, v_cache, out)
    p, (h, d), kvh = q_lens.shape[0], q.shape[1:], k_cache.shape[2]
    group = h // kvh
    block_m, block_n = prefill_tiles(q.dtype)
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group  # query tokens per program (their GROUP heads fill the tile's rows)
    grid = (p, kvh, triton.cdiv(max_q_len, block_q))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, q_start, q_lens, ctx_lens, block_tables, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=d, D_PAD=_pad(d), BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_N=block_n, UPCAST=INTERPRETED, PRECISION=_precision(q.dtype, precision))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, KVH, D] into the caches' slots `slot_mapping` ([T] int64; negative: skipped)."""
    _check(k, v, k_cache, v_cache)
    t, kvh, d = k.shape
    if t == 0:
        return
    _write_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        KV_HEADS=kvh, H_PAD=triton.next_power_of_2(kvh), HEAD_DIM=d, D_PAD=triton.next_power_of_2(d),
        BLOCK_SIZE=k_cache.shape[1])
