"""The layers' pointwise Triton kernels (engine/triton_ops.py) against the torch ops they replace (engine/model.py):
the norm with its residual add, SiLU-and-multiply, the rotary embedding in place. Without CUDA they run under Triton's
interpreter on CPU tensors; marked gpu too, so scripts/gpu-check.sh runs them compiled.

What must hold: the residual add and the rotary are the torch ops' bits (same roundings; a GPU compiling float32
contracts a rotary product and its sum into one FMA, which rounds once where torch rounds twice: within an ulp
there); the norm and SiLU agree to float32 rounding (another summation order, another exp and rsqrt): within a few
float32 ulps, and in bfloat16 within one ulp of the output.
"""

from __future__ import annotations

import pytest
import torch

from engine import model
from engine.config import ModelConfig
from tests.helpers import import_triton_module

CUDA = torch.cuda.is_available()
ops = import_triton_module("engine.triton_ops")

DEV = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float32, torch.bfloat16]
ULPS = {torch.float32: 8.0, torch.bfloat16: 1.0}  # float32: ~5e-7 relative


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The torch path's bits (float32 compiled: within the FMA's rounding of products of values ~1; see the module
    docstring)."""
    if CUDA and b.dtype == torch.float32:
        return torch.allclose(a, b, rtol=3e-7, atol=1e-6)
    return torch.equal(a, b)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def interpreting(monkeypatch: pytest.MonkeyPatch) -> None:
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| in units of the last place of b's dtype at b's magnitude."""
    eps = torch.finfo(b.dtype).eps
    return float(((a.float() - b.float()).abs() / (b.float().abs().clamp_min(1e-3) * eps)).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 4096])
def test_rms_norm_with_the_residual_add(dtype, width) -> None:
    g = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(5, width, generator=g).to(dtype).to(DEV) for _ in range(2))
    w = (1 + 0.1 * torch.randn(width, generator=g)).to(dtype).to(DEV)
    for d in (None, delta):
        out, res = ops.rms_norm(x, w, 1e-5, d)
        ref_out, ref_res = model.rms_norm(x, w, 1e-5, d)
        assert torch.equal(res, ref_res)  # the add rounds as torch's does
        assert _ulps(out, ref_out) <= ULPS[dtype]
    assert ops.rms_norm(x[:0], w, 1e-5)[0].shape == (0, width)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype) -> None:
    x = torch.randn(3, 2 * 1536, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEV) * 3
    assert _ulps(ops.silu_mul(x), model.silu_mul(x)) <= ULPS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kvh,d", [(8, 2, 64), (32, 8, 128)])
def test_rotary_with_the_kv_write_is_the_torch_rotary_and_the_backends_write(dtype, heads, kvh, d) -> None:
    """rotate_and_write on the Triton path (one kernel, in place on a strided view of the qkv projection's output)
    against the torch rotary and the backend's write: the same q, k and cache bits (positions up to the table's
    last), v untouched, and nothing written outside the step's slots."""
    from engine.attention import AttentionMetadata

    bs = 16
    cfg = ModelConfig(name="t", model_id="t", vocab_size=10, hidden_size=heads * d, intermediate_size=8,
                      num_layers=1, num_heads=heads, num_kv_heads=kvh, head_dim=d, rope_theta=10000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=4096)
    qkv = torch.randn(4, heads + 2 * kvh, d, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEV)
    # NOTE: two decode rows (one at the last position), then a 2-token chunk; block 0 is nobody's
    tables, starts, num_new = [[4, 1], [8] * 255 + [5], [7]], [17, 4095, 0], [1, 1, 2]
    positions = torch.tensor([17, 4095, 0, 1], device=DEV)
    results = []
    for triton in (False, True):
        meta = AttentionMetadata.build(tables, starts, num_new, bs, backend="triton", device=DEV)
        caches = [torch.zeros(9, bs, kvh, d, dtype=dtype, device=DEV) for _ in range(2)]
        x = qkv.clone()
        qk, v = x[:, : heads + kvh], x[:, heads + kvh :]
        q, k = model.Rotary(cfg, 4096, DEV, triton).rotation(positions, dtype).rotate_and_write(qk, v, *caches, meta)
        assert torch.equal(v, qkv[:, heads + kvh :])
        results.append((q.clone(), k.clone(), *caches))
    for a, b in zip(*results):
        assert _bits(b, a)
    assert results[1][2].abs().sum() > 0 and results[1][2][0].abs().sum() == 0  # written, and only where asked
