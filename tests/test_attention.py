"""Paged attention: the gather path's length-bucketed decode groups, and the compiled in-place kernel (with
cascade over shared prefixes) against the gather path and against plain attention, number by number."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine.attention import DECODE_PAD_RATIO, PREFILL_MODES, AttentionMetadata, paged_attention, write_kv
from engine.attention.cascade import shared_prefixes
from engine.kernels import ensure_built
from engine.kv_quant import write_quantized


@pytest.fixture(scope="module")
def kernel():
    return ensure_built()  # NOTE: a machine with a compiler must build it: a failure here is a test failure


@pytest.mark.parametrize("lengths", [[5], [17, 1500, 40, 33, 700, 16, 1], [64, 64, 64], [3, 2000]])
def test_decode_groups_match_per_sequence_attention(lengths: list[int]) -> None:
    torch.manual_seed(0)
    bs, kvh, h, d, nb = 16, 2, 6, 8, 400
    k_cache, v_cache = torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)
    perm = torch.randperm(nb).tolist()
    tables, used = [], 0
    for n in lengths:  # context n-1 cached + the new token at position n-1
        need = -(-n // bs)
        tables.append(perm[used:used + need])
        used += need
    meta = AttentionMetadata.build(tables, [n - 1 for n in lengths], [1] * len(lengths), bs, kernel=None)
    q = torch.randn(len(lengths), h, d)
    out = paged_attention(q, torch.zeros(len(lengths), kvh, d), torch.zeros(len(lengths), kvh, d),
                          k_cache, v_cache, meta, scale=0.3)
    for i, (n, table) in enumerate(zip(lengths, tables)):
        ks = k_cache[table].reshape(-1, kvh, d)[:n].repeat_interleave(h // kvh, dim=1)  # [n, H, D]
        vs = v_cache[table].reshape(-1, kvh, d)[:n].repeat_interleave(h // kvh, dim=1)
        ref = F.scaled_dot_product_attention(q[i][:, None], ks.transpose(0, 1), vs.transpose(0, 1), scale=0.3)
        torch.testing.assert_close(out[i], ref[:, 0], rtol=1e-5, atol=1e-5)
    # every entry is in exactly one group, and no group pads beyond the ratio
    rows = sorted(r for g in meta.decode_groups for r in g.rows.tolist())
    assert rows == list(range(len(lengths)))
    for g in meta.decode_groups:
        blocks = [len(tables[r]) for r in g.rows.tolist()]
        assert max(blocks) <= DECODE_PAD_RATIO * min(blocks)
    if len(lengths) == 7:
        assert len(meta.decode_groups) > 1  # 1 block and 94 blocks never share a padded call


BS, KVH, H, D = 16, 3, 9, 64  # SmolLM2's head layout


def _mixed_batch(nb: int, shared_blocks: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Decode entries (four behind `shared_blocks` common blocks, two alone, one in the middle of a block), then
    prefill chunks with cached context (two) and one that starts its sequence."""
    perm = torch.randperm(nb).tolist()
    shared, free = perm[:shared_blocks], perm[shared_blocks:]
    tables: list[list[int]] = []
    starts: list[int] = []
    num_new: list[int] = []

    def take(n: int) -> list[int]:
        out = free[:n]
        del free[:n]
        return out

    for total in (200, 170, 161, 16 * shared_blocks + 1):
        tables.append(shared + take(-(-total // BS) - shared_blocks))
        starts.append(total - 1)
        num_new.append(1)
    for total in (50, 700, 9):
        tables.append(take(-(-total // BS)))
        starts.append(total - 1)
        num_new.append(1)
    for start, n in ((70, 40), (90, 20), (300, 200), (0, 30)):  # (90, 20): short enough for the kernel
        tables.append(take(-(-(start + n) // BS)))
        starts.append(start)
        num_new.append(n)
    return tables, starts, num_new


def _caches(nb: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = torch.randn(nb, BS, KVH, D), torch.randn(nb, BS, KVH, D)
    if dtype != torch.int8:
        return k.to(dtype), v.to(dtype)
    k8, v8 = (torch.zeros(nb, BS + 1, KVH, D, dtype=torch.int8) for _ in range(2))
    write_quantized(k8, k.view(-1, KVH, D), torch.arange(nb * BS))
    write_quantized(v8, v.view(-1, KVH, D), torch.arange(nb * BS))
    return k8, v8


@pytest.mark.parametrize("q_dtype,kv_dtype,tol", [(torch.float32, torch.float32, 2e-5),
                                                  (torch.float32, torch.int8, 2e-5),
                                                  (torch.bfloat16, torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("cascade", [True, False])
def test_kernel_matches_gather_path(kernel, q_dtype, kv_dtype, tol, cascade) -> None:
    torch.manual_seed(1)
    nb = 400
    k_cache, v_cache = _caches(nb, kv_dtype)
    tables, starts, num_new = _mixed_batch(nb, shared_blocks=10)
    t = sum(num_new)
    q, k, v = torch.randn(t, H, D, dtype=q_dtype), torch.randn(t, KVH, D, dtype=q_dtype), torch.randn(
        t, KVH, D, dtype=q_dtype)
    gather = AttentionMetadata.build(tables, starts, num_new, BS, kernel=None)
    # NOTE: prefill="chunked" keeps the kernel on prefill chunks with context of up to 32 rows (flash: up to 3)
    inplace = AttentionMetadata.build(tables, starts, num_new, BS, kernel=kernel, cascade=cascade, prefill="chunked")
    assert inplace.plan is not None
    assert [s.in_plan for s in inplace.prefills] == [False, True, False, False]
    assert [g.members for g in inplace.plan.groups] == ([[0, 1, 2, 3]] if cascade else [])
    ref = paged_attention(q, k, v, k_cache, v_cache, gather, 0.125)
    out = paged_attention(q, k, v, k_cache, v_cache, inplace, 0.125)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_cascade_output_equals_plain_attention_over_whole_context(kernel) -> None:
    """Shared prefix + suffix merged by log-sum-exp = softmax attention over the concatenated context."""
    torch.manual_seed(2)
    nb, lengths, shared = 300, [900, 1000, 913, 1201], 56  # 56 blocks = 896 shared tokens
    k_cache, v_cache = torch.randn(nb, BS, KVH, D), torch.randn(nb, BS, KVH, D)
    perm = torch.randperm(nb).tolist()
    tables, used = [], shared
    for n in lengths:
        own = -(-n // BS) - shared
        tables.append(perm[:shared] + perm[used:used + own])
        used += own
    meta = AttentionMetadata.build(tables, [n - 1 for n in lengths], [1] * 4, BS, kernel=kernel)
    assert meta.plan is not None and meta.plan.groups[0].num_tokens == 896
    q = torch.randn(4, H, D)
    out = paged_attention(q, torch.zeros(4, KVH, D), torch.zeros(4, KVH, D), k_cache, v_cache, meta, 0.125)
    for i, (n, table) in enumerate(zip(lengths, tables)):
        ks = k_cache[table].reshape(-1, KVH, D)[:n].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        vs = v_cache[table].reshape(-1, KVH, D)[:n].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i][:, None], ks, vs, scale=0.125)[:, 0]
        torch.testing.assert_close(out[i], ref, rtol=2e-5, atol=2e-5)


def test_shared_prefixes_group_only_identical_leading_blocks() -> None:
    tables = [[7, 8, 9, 1], [7, 8, 9, 2, 3], [7, 8, 4], [5, 8, 9], [6], [7]]
    ctx = [60, 70, 40, 40, 3, 2]
    groups = shared_prefixes(tables, ctx, block_size=16, min_blocks=1)
    # [7] (ctx 2) pulls the group's common run down to one token short of its end: below one block, no group
    assert groups == []
    groups = shared_prefixes(tables[:5], ctx[:5], block_size=16, min_blocks=1)
    assert [(g.members, g.num_tokens) for g in groups] == [([0, 1, 2], 32)]
    groups = shared_prefixes(tables[:2], ctx[:2], block_size=16, min_blocks=1)
    assert [(g.members, g.num_tokens) for g in groups] == [([0, 1], 48)]
    assert shared_prefixes(tables[:2], ctx[:2], block_size=16, min_blocks=4) == []


def test_without_built_kernels_the_engine_logs_and_uses_the_gather_path_and_onednn(tiny, monkeypatch, tmp_path,
                                                                                   caplog) -> None:
    from engine import kernels
    from tests.helpers import generate_ids, greedy, make_engine

    monkeypatch.setattr(kernels, "BUILD_DIR", tmp_path)  # nothing built there
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.delenv(kernels.ENV, raising=False)
    monkeypatch.delenv(kernels.LINEAR_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="engine.kernels"):
        engine = make_engine(tiny)
    assert engine.runner.attn_kernel is None
    assert {layer.qkv.backend for layer in engine.runner.model.layers} == {"onednn"}
    assert "attention uses the pure-torch gather path and linear layers oneDNN's" in caplog.text
    assert len(generate_ids(engine, [[5, 6, 7, 8]], greedy(4))[0]) == 4
    monkeypatch.setenv(kernels.ENV, "kernel")  # asked for explicitly: an error, not a silent fallback
    with pytest.raises(RuntimeError, match="not built"):
        kernels.attention_kernel()
    monkeypatch.setenv(kernels.LINEAR_ENV, "kernel")
    with pytest.raises(RuntimeError, match="not built"):
        kernels.linear_kernel()


@pytest.mark.parametrize("use_kernel", [False, True])
@pytest.mark.parametrize("q_dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_flash_prefill_matches_chunked_path_and_plain_attention(kernel, use_kernel, q_dtype, tol) -> None:
    """prefill="flash" (one fused SDPA call per chunk) = the 128-row chunked path = causal softmax attention of each
    prefill chunk over its cached context plus itself, on a mixed batch (decode entries, chunks with context, a
    chunk of 200 rows over 300 cached tokens, one starting its sequence)."""
    torch.manual_seed(3)
    nb = 400
    k_cache, v_cache = _caches(nb, q_dtype)
    tables, starts, num_new = _mixed_batch(nb, shared_blocks=10)
    used = {b for table in tables for b in table}
    free = [b for b in range(nb) if b not in used]
    tables += [free[:19], free[19:51]]  # a 300-row chunk starting its sequence; 2 rows over 500 (kernel if flash)
    starts += [0, 500]
    num_new += [300, 2]
    t = sum(num_new)
    q, k, v = (torch.randn(t, heads, D, dtype=q_dtype) for heads in (H, KVH, KVH))
    slots = AttentionMetadata.build(tables, starts, num_new, BS, kernel=None).slot_mapping
    write_kv(k_cache, v_cache, k, v, slots)  # NOTE: as the model does: this step's K/V are in the cache first
    metas = {mode: AttentionMetadata.build(tables, starts, num_new, BS, kernel=kernel if use_kernel else None,
                                           prefill=mode) for mode in PREFILL_MODES}
    assert [s.flash for s in metas["flash"].prefills] == [True] * 6
    assert [s.flash for s in metas["chunked"].prefills] == [False] * 6
    assert [s.in_plan for s in metas["flash"].prefills] == [False] * 5 + [use_kernel]
    assert [s.in_plan for s in metas["chunked"].prefills] == [False, use_kernel, False, False, False, use_kernel]
    outs = {mode: paged_attention(q, k, v, k_cache, v_cache, m, 0.125) for mode, m in metas.items()}
    torch.testing.assert_close(outs["flash"].float(), outs["chunked"].float(), rtol=tol, atol=tol)
    row = num_new.count(1)  # the first prefill row (decode entries come first)
    for table, start, n in zip(tables, starts, num_new):
        if n == 1:
            continue
        ks = k_cache[table].reshape(-1, KVH, D)[: start + n].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        vs = v_cache[table].reshape(-1, KVH, D)[: start + n].repeat_interleave(H // KVH, dim=1).transpose(0, 1)
        mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        ref = F.scaled_dot_product_attention(q[row : row + n].transpose(0, 1).float(), ks.float(), vs.float(),
                                             attn_mask=mask, scale=0.125).transpose(0, 1)
        torch.testing.assert_close(outs["flash"][row : row + n].float(), ref, rtol=tol, atol=tol)
        row += n
