"""`pdcluster bench transfer`'s references: what the transports are measured against (a memcpy, raw TCP to another
process, cma: the copy UCX makes for nixl on one host, without checks), and a receiver's CPU while idle.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import numpy as np

from pdcluster.bench.report import log
from pdcluster.bench.transfer_peers import BenchError, Peer, cma_sink, cpu_seconds, tcp_sink
from pdcluster.bench.transfer_sender import DEADLINE_S, Timing, cpu_since


def figures(seconds: list[float], nbytes: int, timings: list[Timing] | None = None) -> dict[str, Any]:
    """GB/s (best and median of `seconds` for `nbytes`) and, with `timings`, each end's CPU seconds per GB."""
    best, med = min(seconds), statistics.median(seconds)
    row = {"best_gb_s": nbytes / best / 1e9, "median_gb_s": nbytes / med / 1e9, "best_s": best, "median_s": med,
           "runs_s": seconds, "sender_cpu_s_per_gb": None, "receiver_cpu_s_per_gb": None}
    if timings:
        row["sender_cpu_s_per_gb"] = statistics.median(t.sender_cpu_s for t in timings) / (nbytes / 1e9)
        if all(t.receiver_cpu_s is not None for t in timings):
            row["receiver_cpu_s_per_gb"] = statistics.median(
                t.receiver_cpu_s for t in timings if t.receiver_cpu_s is not None) / (nbytes / 1e9)
    return row


def memcpy_figures(nbytes: int, repeat: int) -> dict[str, Any]:
    """numpy copy between two preallocated payload-sized arrays (pages touched first)."""
    src = np.full(nbytes, 7, dtype=np.uint8)
    dst = np.zeros_like(src)
    runs = []
    for _ in range(repeat + 1):
        t = time.perf_counter()
        np.copyto(dst, src)
        runs.append(time.perf_counter() - t)
    return figures(runs[1:], nbytes)


def tcp_figures(nbytes: int, warmup: int, repeat: int) -> dict[str, Any]:
    """Raw TCP on loopback to a sink process: sendall of a memoryview until the sink acks the last byte."""
    import socket

    peer = Peer("tcp", tcp_sink, nbytes)
    try:
        host, port = peer.address.rsplit(":", 1)
        data = np.full(nbytes, 7, dtype=np.uint8).data
        runs: list[Timing] = []
        with socket.create_connection((host, int(port)), timeout=DEADLINE_S) as sock:
            for _ in range(warmup + repeat):
                cpu0 = (cpu_seconds(), cpu_seconds(peer.pid))
                t = time.perf_counter()
                sock.sendall(data)
                if sock.recv(1) != b"k":
                    raise BenchError("tcp sink closed before acking the payload")
                runs.append(Timing(time.perf_counter() - t, *cpu_since(cpu0, peer.pid)))
    finally:
        peer.close()
    return figures([r.seconds for r in runs[warmup:]], nbytes, runs[warmup:])


def cma_figures(nbytes: int, warmup: int, repeat: int) -> dict[str, Any] | None:
    """Linux cross-memory attach into a sink process's buffer (`process_vm_writev`, no checks): the copy UCX's cma
    transport makes for NIXL on one host, so the ceiling of the `nixl` row. None where the kernel refuses it."""
    import ctypes

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "process_vm_writev"):
        return None
    libc.process_vm_writev.restype = ctypes.c_ssize_t
    peer = Peer("cma", cma_sink, nbytes)
    try:
        pid, addr = (int(x) for x in peer.address.split(":"))
        src = np.full(nbytes, 7, dtype=np.uint8)
        runs: list[Timing] = []
        for _ in range(warmup + repeat):
            cpu0 = (cpu_seconds(), cpu_seconds(peer.pid))
            t, done = time.perf_counter(), 0
            while done < nbytes:  # the kernel may write less than asked
                local, remote = IoVec(src.ctypes.data + done, nbytes - done), IoVec(addr + done, nbytes - done)
                n = libc.process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
                if n <= 0:
                    log("transfer", f"cma: process_vm_writev refused ({os.strerror(ctypes.get_errno())}); no cma "
                        "reference")
                    return None
                done += n
            runs.append(Timing(time.perf_counter() - t, *cpu_since(cpu0, peer.pid)))
        if peer.ask("check") != (7, 7):
            raise BenchError("cma sink does not hold the bytes written into it")
    finally:
        peer.close()
    return figures([r.seconds for r in runs[warmup:]], nbytes, runs[warmup:])


def idle_core_pct(pid: int, seconds: float) -> float | None:
    """% of one core process `pid` uses over `seconds` while nothing is sent to it (its transport up)."""
    t0, c0 = time.perf_counter(), cpu_seconds(pid)
    time.sleep(seconds)
    c1 = cpu_seconds(pid)
    return 100 * (c1 - c0) / (time.perf_counter() - t0) if c0 is not None and c1 is not None else None
