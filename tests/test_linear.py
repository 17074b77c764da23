"""The compiled float32 linear kernel (engine/csrc/linear.cpp) against F.linear, number by number, and the engine
on it against the engine on oneDNN, token by token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import kernels
from engine.kernels import ensure_built
from engine.linear import PackedLinear
from tests.helpers import generate_ids, greedy, make_engine


@pytest.fixture(scope="module")
def kernel():
    return ensure_built()  # NOTE: a machine with a compiler must build it: a failure here is a test failure


@pytest.mark.parametrize("m", [0, 1, 3, 8, 9, 17, 64, 257])
@pytest.mark.parametrize("n,k,bias", [(48, 32, False), (37, 576, True), (100, 64, True), (1536, 576, False),
                                     (5, 1536, True)])
def test_kernel_matches_f_linear(kernel, m: int, n: int, k: int, bias: bool) -> None:
    """Row counts from none through decode's 1-16 to prefill's hundreds (passes of 6 rows over 4-block groups, of 8
    over the blocks left over, and their remainders); output counts with only groups, only left-over blocks, both,
    and a partial last block; with and without bias."""
    torch.manual_seed(m * 7 + n)
    w, x = torch.randn(n, k), torch.randn(m, k)
    b = torch.randn(n) if bias else None
    y = kernel.linear(x, kernel.pack_linear(w), n, b)
    assert y.shape == (m, n)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-4, atol=1e-4 * k**0.5)


def test_kernel_takes_strided_inputs_and_rejects_a_foreign_weight(kernel) -> None:
    torch.manual_seed(0)
    w, x = torch.randn(40, 64), torch.randn(6, 128)[:, ::2]  # a column-strided view
    torch.testing.assert_close(kernel.linear(x, kernel.pack_linear(w), 40, None), F.linear(x, w), rtol=1e-4,
                               atol=1e-4)
    with pytest.raises(RuntimeError, match="pack_linear"):
        kernel.linear(x.contiguous(), w, 40, None)  # the plain [N, K] weight is not the blocked one


def test_packed_linear_picks_the_kernel_and_honours_the_env(kernel, monkeypatch) -> None:
    w, x = torch.randn(64, 32), torch.randn(4, 32)
    monkeypatch.delenv(kernels.LINEAR_ENV, raising=False)
    on_kernel = PackedLinear(w)
    assert on_kernel.backend == "kernel"
    monkeypatch.setenv(kernels.LINEAR_ENV, "onednn")
    assert PackedLinear(w).backend in ("onednn", "torch")
    torch.testing.assert_close(on_kernel(x), F.linear(x, w), rtol=1e-4, atol=1e-4)
    assert PackedLinear(w.to(torch.bfloat16)).backend == "torch"  # the kernel is float32 only
    assert torch.equal(on_kernel.plain_weight(), w)  # the blocks undone (what bench engine repacks for oneDNN)


def test_engine_on_the_kernel_gives_the_tokens_of_the_engine_on_onednn(kernel, smollm2, monkeypatch) -> None:
    """Greedy tokens of a mixed continuous batch (short and long prompts, chunked prefill over 64-token steps, decode
    batches of 1-5) are the same with the linear layers on the kernel and on oneDNN."""
    prompts = [[(7 * i + 3 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([5, 130, 17, 300, 2])]
    runs = {}
    for backend in ("onednn", "kernel"):
        monkeypatch.setenv(kernels.LINEAR_ENV, backend)
        engine = make_engine(smollm2, max_num_batched_tokens=64)
        assert {layer.qkv.backend for layer in engine.runner.model.layers} == {backend}
        runs[backend] = generate_ids(engine, prompts, greedy(24))
    assert runs["kernel"] == runs["onednn"]
