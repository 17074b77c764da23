"""The matmul kernel seam: `x @ W.T` with the weight blocked once at load time for the compiled linear kernel
(engine/csrc/linear.cpp), prepacked for oneDNN when the kernel is not built, plain F.linear elsewhere, or weight-only
int8 (per-output-channel scales) for `quantization="int8"`.

NOTE: on this project's 2-core CPU, MKL's sgemm (F.linear) is far from the memory bound at the small M of decode
(1-16 rows), and oneDNN with a prepacked weight only part of the way; the compiled kernel took a batch-1 decode step
on one core from 44 to 27 ms and matches oneDNN at prefill's M (`pdcluster bench engine`, per-core step case).
oneDNN's op is internal to torch (inductor's CPU path uses it), so we probe it once and fall back to F.linear if it
is missing or fails.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.errors import InvalidRequestError
from engine.kernels import linear_kernel

_PACK_HINT = 512  # batch-size hint for the packed layout; measured to serve M = 1..4096 well


@functools.cache
def onednn_available() -> bool:
    """Whether this torch build has the prepacked oneDNN linear and it gives F.linear's result."""
    try:
        w = torch.randn(64, 32)
        x = torch.randn(3, 32)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(y, F.linear(x, w), atol=1e-4, rtol=1e-4))
    except (AttributeError, RuntimeError):
        return False


class PackedLinear:
    """A frozen linear layer; the weight is reordered once, at load time, for `backend`: "kernel" (the compiled one),
    "onednn" or "torch" (F.linear: other devices and dtypes). None: the fastest at hand for the weight."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        cpu_f32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        self.kernel: ModuleType | None = linear_kernel() if cpu_f32 and backend in (None, "kernel") else None
        if backend is None:
            backend = "kernel" if self.kernel is not None else "onednn" if cpu_f32 and onednn_available() else "torch"
        self.backend = backend
        # NOTE: the packed tensors' layouts are not [out, in]; never read them as a plain matrix (see plain_weight()).
        if backend == "kernel":
            if self.kernel is None:
                raise RuntimeError("the compiled linear kernel is not built, or PDCLUSTER_LINEAR=onednn")
            self.weight = self.kernel.pack_linear(weight)
        elif backend == "onednn":
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
        else:
            self.weight = weight

    def plain_weight(self) -> torch.Tensor:
        """The weight as [out, in] (the kernel's blocks undone); oneDNN's opaque layout has no way back."""
        if self.backend == "kernel":  # [ceil(out / 16), in, 16] -> [out, in]
            return self.weight.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features].contiguous()
        if self.backend == "onednn":
            raise ValueError("a oneDNN-packed weight cannot be read back as [out, in]")
        return self.weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] → [T, out]
        if self.kernel is not None:
            return self.kernel.linear(x, self.weight, self.out_features, self.bias)
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q [out, in] int8, scale [out] float32) with weight ≈ q * scale[:, None]."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)  # [out]
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale


class Int8Linear:
    """Weight-only int8 linear layer: int8 weights with a scale per output channel, dequantized inside the matmul.

    NOTE: torch's CPU weight-only kernel (`_weight_int8pack_mm`) is fast only for bfloat16 activations (its float32
    path is a slow generic loop), so activations go through bfloat16 and the result comes back in the input dtype.
    On CUDA the same op serves the same call, behind this one seam.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight, scale = quantize_int8(weight)  # [out, in] int8, [out]
        self.scale = scale.to(torch.bfloat16)
        if weight.device.type != "cpu":
            _check_int8_kernel(weight.device)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with, [out, in] (for tests and quality checks)."""
        return self.weight.float() * self.scale.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] → [T, out]
        y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.scale).to(x.dtype)
        return y if self.bias is None else y + self.bias



@functools.cache
def _check_int8_kernel(device: torch.device) -> None:
    """Refuse, naming `quantization`, a device whose torch has no weight-only int8 kernel (CUDA before torch 2.9);
    probed once per device."""
    try:
        torch._weight_int8pack_mm(torch.zeros(1, 32, dtype=torch.bfloat16, device=device),
                                  torch.zeros(8, 32, dtype=torch.int8, device=device),
                                  torch.ones(8, dtype=torch.bfloat16, device=device))
    except (NotImplementedError, RuntimeError) as e:
        raise InvalidRequestError("quantization", f"int8 needs torch's weight-only int8 kernel on {device.type}, which "
                                  f"torch {torch.__version__} lacks ({type(e).__name__}); use null") from None


def make_linear(quantization: str | None) -> type[PackedLinear] | type[Int8Linear]:
    """The linear layer class for an engine's `quantization` setting (None: the packed float kernel)."""
    return Int8Linear if quantization == "int8" else PackedLinear
