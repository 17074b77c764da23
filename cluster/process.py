"""What a worker's process runs with: its cores, its CPU priority, and a report of both (all threads, Linux).

A pool's `cpu_affinity` and `nice` (pdcluster/config.py) are applied by the actor at start, before the engine
starts its threads, so every thread the process ever has runs with them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


def _each_thread(apply: Callable[[int], None]) -> None:
    """`apply(tid)` to every thread of this process; a thread that ends meanwhile is skipped (its syscalls raise
    ProcessLookupError, its /proc files FileNotFoundError)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            apply(int(tid))
        except (ProcessLookupError, FileNotFoundError):
            pass


def pin_cpus(cpus: tuple[int, ...]) -> None:
    """Pin every thread of this process (and so the threads it starts later) to `cpus` (Linux)."""
    # NOTE: sched_setaffinity(0) pins only the calling thread; Ray's and gRPC's threads already run.
    try:
        _each_thread(lambda tid: os.sched_setaffinity(tid, cpus))
    except OSError as e:
        raise ValueError(f"cpu_affinity: cannot pin to cores {list(cpus)} on this node "
                         f"(it has {sorted(os.sched_getaffinity(0))}): {e}") from None


def set_nice(nice: int) -> None:
    """Give every thread of this process (and so the threads they start later) CPU priority `nice` (Linux)."""
    # NOTE: on Linux a nice value belongs to a thread (setpriority(PRIO_PROCESS, tid)); a new thread inherits its
    # creator's, so the engine loop and torch's OpenMP pool, started after this, run at `nice` too.
    try:
        _each_thread(lambda tid: os.setpriority(os.PRIO_PROCESS, tid, nice))
    except OSError as e:
        raise ValueError(f"nice: cannot set {nice} (below the current "
                         f"{os.getpriority(os.PRIO_PROCESS, 0)} needs CAP_SYS_NICE): {e}") from None


def process_info() -> dict[str, object]:
    """What this process runs with: pid, cores, each thread's nice value, torch's thread count."""
    import torch

    nices: set[int] = set()
    _each_thread(lambda tid: nices.add(os.getpriority(os.PRIO_PROCESS, tid)))
    return {"pid": os.getpid(), "cpus": sorted(os.sched_getaffinity(0)), "nice": sorted(nices),
            "torch_threads": torch.get_num_threads()}


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds so far of this process's live threads, summed by name: a Python thread's own name, else the
    kernel's (Ray's, gRPC's, OpenMP's threads). Linux /proc (the scheduler's nanoseconds); {} elsewhere."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}

    def add(tid: int) -> None:
        try:
            with open(f"/proc/self/task/{tid}/schedstat", encoding="ascii") as f:
                seconds = int(f.read().split()[0]) / 1e9
            name = names.get(tid)
            if name is None:
                with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                    name = f.read().strip()
        except (OSError, ValueError, IndexError):  # NOTE: one thread's files unreadable: skip it, keep the others
            return
        out[name] = out.get(name, 0.0) + seconds

    try:
        _each_thread(add)
    except OSError:
        return {}  # NOTE: no /proc (not Linux)
    return out


def rss_bytes() -> int:
    """Resident memory of this process (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def node_address(host: str) -> str:
    """`host`, or for 'auto' this node's IP as Ray sees it (each worker advertises its own node)."""
    if host != "auto":
        return host
    import ray.util

    return str(ray.util.get_node_ip_address())


def pidfd(pid: int) -> int | None:
    """A descriptor of process `pid` that polls readable once it exited (Linux 5.3+), or None where there is none
    (the process is gone already, another kernel or platform)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs on this node (Linux /proc; a zombie, dead but not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False
