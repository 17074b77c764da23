"""Decode attention over length-bucketed groups equals plain attention over each sequence's own context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention import DECODE_PAD_RATIO, AttentionMetadata, paged_attention


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
    meta = AttentionMetadata.build(tables, [n - 1 for n in lengths], [1] * len(lengths), bs)
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
