"""The Triton LoRA kernels (engine/lora/sgmv.py) against the torch oracle (per segment: x[rows] @ A.T @ B.T in
float64), on segments of uneven lengths (longer than a program's block), interleaved rows and base rows left alone.
Without CUDA they run under Triton's interpreter on CPU tensors; marked gpu too, so scripts/gpu-check.sh runs them
compiled. Tolerance: float32 within 1e-5 relative (another summation order; h stays float32 between the two
matmuls), bfloat16 within two ulps of the output's scale (the sum is rounded once, to y's dtype).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import import_triton_module

CUDA = torch.cuda.is_available()
sgmv = import_triton_module("engine.lora.sgmv")
DEV = torch.device("cuda" if CUDA else "cpu")
pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,ranks", [(64, 96, (4, 16, 8)), (160, 64, (16, 1, 16))])
def test_sgmv_adds_each_segment_s_adapter_delta(dtype, k, n, ranks) -> None:
    g = torch.Generator().manual_seed(k + n)
    slots, width, t = 4, 16, 41
    a = torch.zeros(slots, width, k)
    b = torch.zeros(slots, n, width)
    used = [3, 0, 2]  # slot per segment (slot 1 is loaded with nothing here: its zeros are never read)
    for slot, r in zip(used, ranks):
        a[slot, :r] = torch.randn(r, k, generator=g) / k**0.5
        b[slot, :, :r] = torch.randn(n, r, generator=g) / r**0.5
    x = torch.randn(t, k, generator=g)
    y = torch.randn(t, n, generator=g)
    # NOTE: 20 rows in the first segment (over BLOCK_M = 16), interleaved over the batch; rows 38-40 are the base's
    order = torch.randperm(38, generator=g).tolist()
    segments = [order[:20], order[20:23], order[23:]]
    rows = [r for seg in segments for r in seg]
    starts = [0, 20, 23, 38]
    want = y.double().clone()
    for seg, slot in zip(segments, used):
        want[seg] += x[seg].double() @ a[slot].double().T @ b[slot].double().T
    yd = y.to(dtype).to(DEV)
    a_t, b_t = a.transpose(1, 2).contiguous(), b.transpose(1, 2).contiguous()  # the slots' layout
    sgmv.add_lora(x.to(dtype).to(DEV), yd, a_t.to(dtype).to(DEV), b_t.to(dtype).to(DEV),
                  torch.tensor(rows, dtype=torch.long, device=DEV), torch.tensor(starts, dtype=torch.int32,
                  device=DEV), torch.tensor(used, dtype=torch.int32, device=DEV), 20)
    got = yd.double().cpu()
    assert torch.equal(got[38:], y[38:].to(dtype).double())  # base rows untouched
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    else:  # the inputs were rounded to bfloat16 too: compare with the same math on the rounded inputs
        ref = y.to(dtype).double().clone()
        for seg, slot in zip(segments, used):
            ref[seg] += x[seg].to(dtype).double() @ a[slot].to(dtype).double().T @ b[slot].to(dtype).double().T
        assert ((got - ref).abs() <= 2 * 2**-8 * ref.abs().clamp_min(1.0)).all()


@pytest.mark.skipif(CUDA, reason="the interpreted engine on the CPU; on a GPU the next test compares")
def test_an_engine_on_the_triton_backend_gives_the_torch_path_s_tokens(tiny, tmp_path, monkeypatch) -> None:
    """The tiny model end to end with PDCLUSTER_ATTENTION=triton (interpreted): base and two adapters in one batch
    give the tokens of the torch LoRA path (gather backend), and the kernels computed the deltas."""
    import dataclasses

    from engine.kernels import ENV
    from tests.helpers import generate_ids, greedy, make_engine, random_prompts
    from tests.lora_adapters import make_adapter

    calls = []
    real = sgmv.add_lora
    monkeypatch.setattr(sgmv, "add_lora", lambda *a: (calls.append(1), real(*a)))
    paths = {n: make_adapter(str(tmp_path / n), tiny, rank=r, seed=r) for n, r in (("a", 4), ("b", 16))}
    prompts = random_prompts(4, [7, 19], vocab=tiny.config.vocab_size, seed=2)
    names = ["a", None, "b", "a"]

    def run(backend: str) -> list[list[int]]:
        monkeypatch.setenv(ENV, backend)
        engine = make_engine(tiny, max_loras=2)
        assert engine.runner.attn_backend == backend
        for name, path in paths.items():
            engine.load_lora(name, path)
        for i, (p, name) in enumerate(zip(prompts, names)):
            engine.add_request(f"r{i}", p, dataclasses.replace(greedy(6), lora=name))
        from tests.helpers import run_to_completion

        final = run_to_completion(engine)
        return [final[f"r{i}"].token_ids for i in range(len(prompts))]

    ref = run("gather")
    assert not calls
    assert run("triton") == ref
    assert calls  # the Triton kernels added the deltas
    assert generate_ids(make_engine(tiny), prompts[1:2], greedy(6)) == [ref[1]]


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_adapter_tokens_on_a_gpu_equal_the_merged_model(tiny, tmp_path) -> None:
    """On CUDA in float32: the Triton kernels' adapter tokens are the merged model's."""
    import dataclasses

    from tests.helpers import generate_ids, greedy, make_engine, random_prompts
    from tests.lora_adapters import make_adapter, merged_model

    path = make_adapter(str(tmp_path / "a"), tiny, rank=8, seed=3)
    prompts = random_prompts(8, [5, 17, 33], vocab=tiny.config.vocab_size, seed=3)
    engine = make_engine(tiny, device="cuda", dtype="float32", max_loras=2)
    engine.load_lora("a", path)
    ours = generate_ids(engine, prompts, dataclasses.replace(greedy(12), lora="a"))
    merged = make_engine(merged_model(tiny, path), device="cuda", dtype="float32", enforce_eager=True)
    assert ours == generate_ids(merged, prompts, greedy(12))
