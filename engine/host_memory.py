"""Large host tensors in transparent huge pages (Linux), for the KV pool.

A KV pool is written by other processes: NIXL's same-host path (UCX's cma transport) copies into it with
`process_vm_writev`, which pins the destination page by page. On 4 KiB pages that copy ran at ~6 GB/s here, on
2 MiB pages at ~11 GB/s (`pdcluster bench transfer`, its cma reference; BENCHMARKS.md, issue 30). Linux gives a
mapping huge pages on request (`madvise(MADV_HUGEPAGE)`) in its default THP mode ("madvise"), as numpy does for
its own large arrays; the request has to come before the pages are first touched.

So a large pool is its own private anonymous mapping, aligned to 2 MiB and advised before any write. The kernel
hands such pages out zeroed on first touch, so the pool is zeros without writing them: a worker no longer spends
part of its start zeroing a 1.5 GB pool it may barely use (longer when free memory is fragmented and the kernel
compacts it for 2 MiB pages), and its memory grows with the blocks it fills, as the pool vLLM's CPU cache engine
makes with `torch.empty` does. The first write into
each 2 MiB page pays its fault (the engine's warm-up takes the first of them). Small tensors, devices other than
the host, and systems other than Linux get `torch.zeros`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
LAZY_BYTES = 8 * HUGE_PAGE  # smaller tensors: torch.zeros (a mapping of their own is not worth it)
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


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
          what: str = "") -> torch.Tensor:
    """`torch.zeros`; on the Linux host, from `LAZY_BYTES` up, in a 2 MiB-aligned private mapping advised huge pages
    whose pages the kernel zeroes on first touch (the module's note).

    NOTE: such memory is taken as it is written, so a pool larger than the machine can give fails late (the kernel's
    OOM killer, mid-serving) instead of at its start: where it is larger than what is available now, a warning
    names it (`what`: the setting that sizes it)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < LAZY_BYTES or _madvise() is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    name, free = what or "a host tensor", available_bytes()
    if free is not None and nbytes > free:
        log.warning("%s: %.2f GiB of host memory as it fills, more than the %.2f GiB available now (MemAvailable or "
                    "the cgroup's limit): this process may be killed for memory under load", name, nbytes / 2**30,
                    free / 2**30)
    # NOTE: MAP_PRIVATE: a shared anonymous mapping is shmem, whose huge pages are a separate, usually off, setting.
    # The tensor's storage holds the mapping; it is unmapped when the last view goes.
    try:
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    except OSError as e:  # NOTE: e.g. vm.overcommit_memory=2 (strict) with too little left to commit
        raise MemoryError(f"{name}: cannot map {nbytes / 2**30:.2f} GiB of host memory: {e}") from e
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    t = whole[start:start + nbytes].view(dtype).view(shape)
    advise_huge_pages(t)
    return t


def available_bytes() -> int | None:
    """Memory this process could still take: the kernel's MemAvailable, or less where a cgroup (v2) limits it (None:
    not Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free
