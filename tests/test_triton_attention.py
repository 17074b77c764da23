"""The Triton attention kernels against the pure-torch gather path, number by number: split-KV decode with GQA,
block boundaries, prefill chunks over a cached context, the KV write, padded rows and the static metadata a CUDA
graph reads. Without CUDA they run under Triton's interpreter on CPU tensors (the same kernels a GPU compiles); the
kernel tests are also marked gpu, so scripts/gpu-check.sh (pytest -m gpu) runs them compiled on the device.

Tolerances: float32 kernels use input_precision="ieee" (exact fp32 products), so they differ from the reference only
by summation order (~1e-6). bfloat16: the output is rounded to bf16 (one ulp = 2^-7 relative, 0.016 at |x| ~ 2) and,
compiled, the softmax weights are rounded to bf16 before the P @ V product; 2e-2 covers both.
"""

from __future__ import annotations

import pytest
import torch

from engine.attention import AttentionMetadata, num_kv_splits, paged_attention, select_backend, write_kv
from engine.attention.triton_backend import SDPA_MIN_ROWS, aligned_width
from engine.kernels import ENV
from engine.stats import EngineStats
from tests.helpers import import_triton_module

# NOTE: Triton decides at decoration time whether a kernel is interpreted, so TRITON_INTERPRET must be on when the
# kernels module is first imported (and at launch: triton reads it again then, which the autouse fixture sees to)
CUDA = torch.cuda.is_available()
tk = import_triton_module("engine.attention.triton_kernels")

DEV = torch.device("cuda" if CUDA else "cpu")
BS = 16
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET on while a test of this module runs on the CPU."""
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _tables(lengths: list[int], nb: int, seed: int = 0) -> list[list[int]]:
    """Disjoint random block tables holding `lengths` tokens each."""
    perm = torch.randperm(nb, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in lengths:
        need = -(-n // BS)
        tables.append(perm[used : used + need])
        used += need
    assert used <= nb
    return tables


def _data(t: int, h: int, kvh: int, d: int, nb: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t, n, d, generator=g).to(dtype) for n in (h, kvh, kvh))
    kc, vc = (torch.randn(nb, BS, kvh, d, generator=g).to(dtype) for _ in range(2))
    return tuple(x.to(DEV) for x in (q, k, v, kc, vc))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
               tables: list[list[int]], starts: list[int], num_new: list[int]) -> torch.Tensor:
    """The gather path in float32 (its own tests hold it to plain softmax attention)."""
    meta = AttentionMetadata.build(tables, starts, num_new, BS, backend="gather", device=DEV)
    f = [x.float() for x in (q, k, v, kc, vc)]
    return paged_attention(f[0], f[1], f[2], f[3], f[4], meta, 0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 16)])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_decode_matches_reference_across_block_boundaries_and_splits(dtype, heads, kv_heads, head_dim,
                                                                      splits) -> None:
    # NOTE: contexts 1, block_size - 1, block_size, block_size + 1 and a long one (300 tokens: 5 ranges of 64 keys)
    lengths = [1, BS - 1, BS, BS + 1, 300]
    nb = 40
    tables = _tables(lengths, nb)
    starts, num_new = [n - 1 for n in lengths], [1] * len(lengths)
    q, k, v, kc, vc = _data(len(lengths), heads, kv_heads, head_dim, nb, dtype)
    meta = AttentionMetadata.build(tables, starts, num_new, BS, backend="triton", device=DEV)
    assert meta.triton is not None and meta.triton.num_splits == num_kv_splits(5, aligned_width(19), BS)
    assert meta.triton.block_tables.shape[1] == 32  # NOTE: 19 blocks, aligned to TABLE_ALIGN
    out = torch.empty_like(q)
    t = meta.triton
    tk.decode(q, kc, vc, t.block_tables, t.seq_lens, splits or t.num_splits, 0.125, out)
    ref = _reference(q, k, v, kc, vc, tables, starts, num_new)
    torch.testing.assert_close(out.float(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_eager_steps_take_only_the_shapes_the_decode_graphs_compiled() -> None:
    """Split counts are powers of two and eager block tables multiples of TABLE_ALIGN wide: Triton compiles no new
    variant of the decode and prefill kernels batch after batch (issue 38's colocated stalls); a graph's static
    width is kept."""
    assert {num_kv_splits(rows, w, BS) for rows in range(1, 300) for w in range(1, 700)} == {1, 2, 4, 8, 16}
    assert [aligned_width(w) for w in (0, 1, 15, 16, 17, 512)] == [0, 16, 16, 16, 32, 512]
    tables, starts = [[1, 2, 3], [4] * 20], [40, 300]
    eager = AttentionMetadata.build(tables, starts, [1, 1], BS, backend="triton")
    graph = AttentionMetadata.build(tables, starts, [1, 1], BS, backend="triton", pad_rows=4, pad_blocks=37,
                                    pad_block=9)
    assert eager.triton is not None and eager.triton.block_tables.shape == (2, 32)
    assert graph.triton is not None and graph.triton.block_tables.shape == (4, 37)
    mixed = AttentionMetadata.build([[1], [2, 3, 4]], [5, 20], [1, 8], BS, backend="triton")
    assert mixed.triton is not None and mixed.triton.ctx_block_tables.shape == (1, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16)])
def test_prefill_chunks_over_a_cached_context_in_a_mixed_batch(dtype, heads, kv_heads, head_dim) -> None:
    """Decode rows, chunks whose cached context ends before / at / after a block boundary (speculative-verification
    sized and longer than one 32-row tile), a short chunk that starts its sequence (the same varlen launch) and a
    long one (SDPA), in one step; GQA (a group of 3 in 64-row tiles: 21 tokens each) and plain multi-head."""
    h, kvh, d, nb = heads, kv_heads, head_dim, 64
    starts = [40, 7, 1, BS - 1, BS, BS + 1, 100, 0, 0]
    num_new = [1, 1, 3, 2, 17, 40, 70, 33, SDPA_MIN_ROWS + 4]
    tables = _tables([s + n for s, n in zip(starts, num_new)], nb, seed=2)
    q, k, v, kc, vc = _data(sum(num_new), h, kvh, d, nb, dtype)
    meta = AttentionMetadata.build(tables, starts, num_new, BS, backend="triton", device=DEV)
    assert meta.triton is not None and meta.triton.own == [(sum(num_new[:-1]), SDPA_MIN_ROWS + 4)]
    assert meta.triton.q_lens.tolist() == num_new[2:-1] and meta.triton.max_q_len == 70
    write_kv(kc, vc, k, v, meta)  # as the model does: this step's K/V are in the cache first
    out = paged_attention(q, k, v, kc, vc, meta, 0.125)
    ref = _reference(q, k, v, kc, vc, tables, starts, num_new)
    torch.testing.assert_close(out.float(), ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_stores_exactly_what_index_copy_does(dtype) -> None:
    t, kvh, d, nb = 37, 3, 64, 8
    fused = torch.randn(t, 9 + 2 * kvh, d).to(dtype).to(DEV)  # k and v as the model has them: strided views
    k, v = fused[:, 9 : 9 + kvh], fused[:, 9 + kvh :]
    slots = torch.randperm(nb * BS, generator=torch.Generator().manual_seed(3))[:t].to(DEV)
    kc, vc = torch.zeros(2, nb, BS, kvh, d, dtype=dtype, device=DEV)
    tk.write_kv(kc, vc, k, v, slots)
    kr, vr = torch.zeros(2, nb, BS, kvh, d, dtype=dtype, device=DEV)
    kr.view(-1, kvh, d).index_copy_(0, slots, k)
    vr.view(-1, kvh, d).index_copy_(0, slots, v)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    skip = slots.clone()
    skip[::2] = -1  # negative slots are not written
    kc.zero_(), vc.zero_()
    tk.write_kv(kc, vc, k, v, skip)
    assert torch.equal(kc.view(-1, kvh, d)[slots[1::2]], k[1::2]) and int(kc.ne(0).sum()) == k[1::2].numel()


@pytest.mark.gpu
def test_padded_rows_and_the_static_metadata_of_a_graph() -> None:
    """A decode batch of 3 padded to 8 rows and to the static table width, copied into a static metadata: the real
    rows match the reference, padded rows write and read only the spare block, and other shapes are refused."""
    h, kvh, d, nb, spare, width = 8, 2, 16, 24, 23, 6
    lengths = [5, BS + 1, 70]
    tables = _tables(lengths, nb - 1, seed=4)
    starts = [n - 1 for n in lengths]
    static = AttentionMetadata.build([[spare]] * 8, [0] * 8, [1] * 8, BS, backend="triton", device=DEV,
                                     pad_blocks=width, pad_block=spare)
    assert static.triton is not None
    views = (static.slot_mapping, static.triton.block_tables, static.triton.seq_lens)
    meta = AttentionMetadata.build(tables, starts, [1] * 3, BS, backend="triton", device=DEV, pad_rows=8,
                                   pad_blocks=width, pad_block=spare, out=static)
    assert meta is static and (static.slot_mapping, static.triton.block_tables, static.triton.seq_lens) == views
    assert static.triton.seq_lens.tolist() == [5, BS + 1, 70] + [1] * 5
    assert static.slot_mapping[3:].tolist() == [spare * BS] * 5
    assert static.triton.block_tables.shape == (8, width) and static.triton.num_splits == num_kv_splits(8, width, BS)
    q, k, v, kc, vc = _data(8, h, kvh, d, nb, torch.float32)
    before = kc.clone()
    write_kv(kc, vc, k, v, static)
    out = paged_attention(q, k, v, kc, vc, static, 0.125)
    real = _reference(q[:3], k[:3], v[:3], kc, vc, tables, starts, [1] * 3)
    torch.testing.assert_close(out[:3], real, rtol=2e-5, atol=2e-5)
    changed = kc.ne(before).any(dim=(1, 2, 3)).nonzero().flatten().tolist()
    assert set(changed) <= {b for t in tables for b in t} | {spare}
    assert torch.equal(kc[spare, 1:], before[spare, 1:])  # only the spare block's first slot
    # the padded rows attend one key, the spare slot (written by one of them): its value
    assert any(torch.equal(vc[spare, 0], v[i]) for i in range(3, 8))
    torch.testing.assert_close(out[3:], vc[spare, 0].repeat_interleave(h // kvh, dim=0).expand(5, h, d))
    again = AttentionMetadata.build(tables[:2], starts[:2], [1] * 2, BS, backend="triton", device=DEV, pad_rows=8,
                                    pad_blocks=width, pad_block=spare)
    static.copy_from(again)
    assert static.triton.seq_lens.tolist() == [5, BS + 1] + [1] * 6
    wider = AttentionMetadata.build(tables, starts, [1] * 3, BS, backend="triton", device=DEV, pad_rows=8,
                                    pad_blocks=width + 1, pad_block=spare)
    with pytest.raises(ValueError, match="shapes differ"):
        static.copy_from(wider)
    with pytest.raises(ValueError, match="decode-only"):
        AttentionMetadata.build(tables + [[0]], starts + [0], [1, 1, 1, 4], BS, backend="triton", pad_rows=8)


def test_backend_selection(monkeypatch) -> None:
    from engine.attention import backend

    monkeypatch.setattr(backend, "attention_kernel", lambda: None)  # as on a machine without the built kernel
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend("cpu") == "gather"
    assert select_backend("cuda") == "triton" and select_backend("cuda:1", torch.int8) == "gather"
    monkeypatch.setenv(ENV, "triton")
    assert select_backend("cuda") == "triton"
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        select_backend("cpu")
    with pytest.raises(ValueError, match="int8"):
        select_backend("cuda", torch.int8)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_backend("cpu") == "triton"
    monkeypatch.setenv(ENV, "kernel")
    with pytest.raises(ValueError, match="CPU kernel"):
        select_backend("cuda")
    monkeypatch.setenv(ENV, "gather")
    assert select_backend("cuda") == "gather"
    monkeypatch.setenv(ENV, "flash")
    with pytest.raises(ValueError, match=ENV):
        select_backend("cpu")


class _NoHostTensors(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on any op that returns a CPU tensor."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                raise AssertionError(f"{func} made a host tensor")
        return out


def test_gather_path_runs_on_another_device_without_host_tensors() -> None:
    """The gather path's layers only read device metadata: on the meta device no op makes a CPU tensor."""
    dev = torch.device("meta")
    tables, starts, num_new = [[3, 4], [5], [1, 2, 6], [8]], [20, 3, 10, 0], [1, 1, 30, 5]
    for prefill in ("flash", "chunked"):
        meta = AttentionMetadata.build(tables, starts, num_new, BS, backend="gather", prefill=prefill, device=dev)
        q, k, v = (torch.empty(37, n, 16, device=dev) for n in (4, 2, 2))
        kc, vc = torch.empty(2, 10, BS, 2, 16, device=dev)
        with _NoHostTensors():
            write_kv(kc, vc, k, v, meta)
            out = paged_attention(q, k, v, kc, vc, meta, 0.25)
        assert out.shape == (37, 4, 16) and out.device == dev


def _run_engine(loaded, backend: str, monkeypatch, first: list[int], rest: list[list[int]], n: int,
                **cfg: object) -> tuple[list[list[int]], EngineStats]:
    """Greedy tokens of `first` (alone until its prompt is computed, so its blocks are cached), then `rest` joining."""
    from tests.helpers import first_then_rest, make_engine

    monkeypatch.setenv(ENV, backend)
    engine = make_engine(loaded, **cfg)
    assert engine.runner.attn_backend == backend
    return first_then_rest(engine, first, rest, n), engine.stats()


@pytest.mark.skipif(CUDA, reason="the interpreted engine on the CPU; on a GPU pdcluster.bench.engine_gpu compares")
@pytest.mark.parametrize("case", ["prefix_cache", "chunked_prefill_preemption"])
def test_engine_gives_the_gather_paths_greedy_tokens(tiny, monkeypatch, case) -> None:
    """The tiny model end to end with PDCLUSTER_ATTENTION=triton (interpreted on the CPU): the same greedy tokens as
    the gather path, with prompts behind a cached shared prefix, and with 24-token steps (chunks over their cached
    context) in 12 blocks (preemption and recompute)."""
    from tests.helpers import random_prompts

    calls = {"decode": 0, "prefill": 0}
    for name in calls:
        real = getattr(tk, name)

        def spy(*args: object, _real=real, _name=name, **kwargs: object) -> None:
            calls[_name] += 1
            _real(*args, **kwargs)

        monkeypatch.setattr(tk, name, spy)
    vocab = tiny.config.vocab_size
    if case == "prefix_cache":
        shared = random_prompts(1, [40], vocab=vocab, seed=7)[0]
        tails = random_prompts(3, [5, 9, 17], vocab=vocab, seed=8)
        first, rest, n, cfg = shared + tails[0], [shared + t for t in tails[1:]], 8, {}
    else:
        prompts = random_prompts(3, [45, 38, 50], vocab=vocab, seed=9)
        first, rest, n = prompts[0], prompts[1:], 24
        cfg = dict(num_blocks=12, max_num_batched_tokens=24, enable_prefix_caching=False)
    ref, _ = _run_engine(tiny, "gather", monkeypatch, first, rest, n, **cfg)
    out, stats = _run_engine(tiny, "triton", monkeypatch, first, rest, n, **cfg)
    assert out == ref and all(len(t) == n for t in out)
    assert calls["decode"] > 0 and calls["prefill"] > 0  # the kernels computed it (chunks with context included)
    if case == "prefix_cache":
        assert stats.cached_prompt_tokens >= 2 * 32  # the followers' first two blocks came from the cache
    else:
        assert stats.num_preemptions > 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_cuda_graph_replays_decode_over_the_static_metadata() -> None:
    """The runner's recipe (engine/attention/__init__.py): one warm-up step, capture write + attention over a static
    metadata of 8 rows, then per step build(..., out=static) and replay; each replay matches the reference."""
    h, kvh, d, nb, spare, width, rows = 9, 3, 64, 64, 63, 8, 8
    kc, vc = torch.randn(2, nb, BS, kvh, d, device=DEV, dtype=torch.bfloat16)
    static = AttentionMetadata.build([[spare]] * rows, [0] * rows, [1] * rows, BS, backend="triton", device=DEV,
                                     pad_blocks=width, pad_block=spare)
    q, k, v = (torch.zeros(rows, n, d, device=DEV, dtype=torch.bfloat16) for n in (h, kvh, kvh))

    def step() -> torch.Tensor:
        write_kv(kc, vc, k, v, static)
        return paged_attention(q, k, v, kc, vc, static, 0.125)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # NOTE: Triton compiles on the first launch, which must not happen during capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed, lengths in ((5, [3, BS, 100]), (6, [BS + 1, 1, 40, 7, 120, 2])):
        tables = _tables(lengths, nb - 1, seed=seed)
        starts = [n - 1 for n in lengths]
        AttentionMetadata.build(tables, starts, [1] * len(lengths), BS, backend="triton", device=DEV, pad_rows=rows,
                                pad_blocks=width, pad_block=spare, out=static)
        g = torch.Generator(device=DEV).manual_seed(seed)
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, device=DEV, generator=g))
        graph.replay()
        n = len(lengths)
        ref = _reference(q[:n], k[:n], v[:n], kc, vc, tables, starts, [1] * n)
        torch.testing.assert_close(out[:n].float(), ref, rtol=TOL[torch.bfloat16], atol=TOL[torch.bfloat16])
