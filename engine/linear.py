"""The matmul kernel seam: `x @ W.T` with weights prepacked for oneDNN on CPU, plain F.linear elsewhere.

NOTE: on this project's 2-core CPU, MKL's sgemm (F.linear) is far from the memory bound at the small M of decode
(1-16 rows); in a development microbenchmark oneDNN with a prepacked weight was clearly faster at every M we use,
and `pdcluster bench engine` shows the effect end to end. The op is internal to torch (inductor's CPU path uses it), so
we probe it once and fall back to F.linear if it is missing or fails.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

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
    """A frozen linear layer; the weight is reordered once, at load time, for the fastest kernel at hand."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.onednn = weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_available()
        # NOTE: the packed tensor's memory layout is opaque; never read it as a plain [out, in] matrix.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT) if self.onednn else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] → [T, out]
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
