"""Large host tensors in transparent huge pages (Linux), for the KV pool.

A KV pool is written by other processes: NIXL's same-host path (UCX's cma transport) copies into it with
`process_vm_writev`, which pins the destination page by page. On 4 KiB pages that copy ran at ~6 GB/s here, on
2 MiB pages at ~11 GB/s (`pdcluster bench transfer`, its cma reference; BENCHMARKS.md, issue 30). Linux gives a
mapping huge pages on request (`madvise(MADV_HUGEPAGE)`) in its default THP mode ("madvise"), as numpy does for
its own large arrays; the request has to come before the pages are first touched, so the tensor is allocated
empty, advised, then zeroed. Where the kernel has THP off ("never") or is not Linux, this is `torch.zeros`.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    fn = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages for the 2 MiB-aligned part of `t`'s memory; False where there is none or it was refused.

    NOTE: pages already touched stay small (khugepaged may merge them later): call it before the first write.
    """
    madvise = _madvise()
    start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    end = (t.data_ptr() + t.untyped_storage().nbytes()) // HUGE_PAGE * HUGE_PAGE
    if madvise is None or t.device.type != "cpu" or end <= start:
        return False
    return madvise(start, end - start, MADV_HUGEPAGE) == 0


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.zeros`, on the host in huge pages where the kernel grants them."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    advise_huge_pages(t)
    return t.zero_()
