"""The engine's host KV pool in transparent huge pages (engine/host_memory.py)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from engine import host_memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding `addr`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            start, end = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = start <= addr < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_zeros_is_torch_zeros():
    t = host_memory.zeros((3, 5, 1 << 18), torch.float32)
    assert t.shape == (3, 5, 1 << 18) and t.dtype == torch.float32 and not t.any()
    assert host_memory.zeros((2, 3), torch.int8).equal(torch.zeros(2, 3, dtype=torch.int8))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="needs Linux with transparent huge pages not turned off")
def test_a_kv_pool_sized_tensor_is_advised_huge_pages():
    """The pool's mapping may get huge pages (THPeligible); whether the kernel finds free 2 MiB pages for it at that
    moment is its own affair (a fragmented machine falls back to small pages: AnonHugePages 0)."""
    t = host_memory.zeros((32 << 20,), torch.uint8)
    fields = _mapping_of(t.data_ptr() + (16 << 20))
    assert fields.get("THPeligible") == "1", fields
    if "[madvise]" in THP.read_text():  # the usual mode: only advised mappings may get huge pages
        plain = torch.zeros(32 << 20, dtype=torch.uint8)  # what the pool was before
        assert _mapping_of(plain.data_ptr() + (16 << 20)).get("THPeligible") == "0"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the lazy mapping is Linux's")
def test_a_large_pool_is_zeros_without_a_write_fills_as_used_and_is_unmapped_with_its_last_view():
    t = host_memory.zeros((4, 16 << 20), torch.uint8)
    addr = t.data_ptr()
    assert addr % host_memory.HUGE_PAGE == 0 and t.is_contiguous()

    def resident_kib() -> int:
        return int(_mapping_of(addr)["Rss"].split()[0])

    assert resident_kib() < 1024, "the pool was written at allocation"
    assert not t.any()
    t[2, :100].fill_(7)
    assert 4 <= resident_kib() <= 4096 and int(t.sum()) == 700
    row = t[2]
    del t
    gc.collect()
    assert int(row.sum()) == 700 and _mapping_of(addr)  # a view keeps the mapping
    del row
    gc.collect()
    assert not _mapping_of(addr)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MemAvailable is Linux's")
def test_a_pool_larger_than_the_memory_available_is_named_in_a_warning(monkeypatch, caplog):
    free = host_memory.available_bytes()
    assert free is not None and 0 < free
    host_memory.zeros((32 << 20,), torch.uint8, what="the KV cache (num_kv_blocks)")
    assert "num_kv_blocks" not in caplog.text
    monkeypatch.setattr(host_memory, "available_bytes", lambda: 16 << 20)
    host_memory.zeros((32 << 20,), torch.uint8, what="the KV cache (num_kv_blocks)")
    assert "the KV cache (num_kv_blocks): 0.03 GiB of host memory as it fills, more than the 0.02 GiB" in caplog.text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the lazy mapping is Linux's")
def test_a_pool_the_system_will_not_map_fails_naming_it(monkeypatch):
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(host_memory.mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match=r"the KV cache \(num_kv_blocks\): cannot map 0.03 GiB of host memory"):
        host_memory.zeros((32 << 20,), torch.uint8, what="the KV cache (num_kv_blocks)")
