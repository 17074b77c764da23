"""Which attention backend an engine uses: `PDCLUSTER_ATTENTION` (auto | kernel | gather | triton) resolved for the
engine's device, once, by the model runner."""

from __future__ import annotations

import importlib.util
import os

import torch

from engine.kernels import ENV, attention_kernel, backend_choice

# The backends behind engine.attention.paged_attention (select_backend returns one of these).
RESOLVED = ("kernel", "gather", "triton")


def triton_interpreting() -> bool:
    """Whether TRITON_INTERPRET is on (read as Triton reads it): Triton kernels then run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on", "y")


def select_backend(device: torch.device | str = "cpu", kv_dtype: torch.dtype | None = None) -> str:
    """The attention backend for an engine on `device` with KV stored as `kv_dtype`: "kernel", "gather" or "triton".

    auto: "triton" on CUDA (the gather path for an int8 KV cache, which the Triton kernels do not read, or without
    triton installed), on the CPU
    the compiled kernel when built, else "gather". An explicit choice that cannot run raises, naming the variable.
    """
    dev = torch.device(device)
    choice = backend_choice()
    int8 = kv_dtype == torch.int8
    if choice == "auto":
        if dev.type == "cuda":
            return "gather" if int8 or importlib.util.find_spec("triton") is None else "triton"
        return "kernel" if dev.type == "cpu" and attention_kernel() is not None else "gather"
    if choice == "kernel":
        if dev.type != "cpu":
            raise ValueError(f"{ENV}=kernel is the compiled CPU kernel; the engine's device is {dev} (use triton or "
                             "gather)")
        attention_kernel()  # NOTE: raises when it is not built
        return "kernel"
    if choice == "triton":
        if int8:
            raise ValueError(f"{ENV}=triton does not read an int8 KV cache (kv_cache_dtype=int8); use gather")
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError(f"{ENV}=triton but triton is not installed")
        if dev.type == "cpu" and not triton_interpreting():
            raise RuntimeError(f"{ENV}=triton on the CPU runs only under Triton's interpreter (TRITON_INTERPRET=1, "
                               "set before the kernels are imported)")
        return "triton"
    return "gather"
