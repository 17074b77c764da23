"""Workers pinned to the same cores share them: processor sharing between their steps.

A pool's `cpu_affinity` can put several actors on one core (deploy/bench-routing.yaml runs two prefill workers on
core 0). While k of them are in a step, each advances at 1/k of its speed; every start or end of a step on the core
re-times the others' ends. Workers with a core to themselves (or GPUs) never come here.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Generic, TypeVar

# NOTE: any hashable key stands for a worker (the simulator passes its Worker objects), so this module needs no
# import of sim_worker, which holds SharedCore itself
Worker = TypeVar("Worker", bound=Hashable)


class SharedCore(Generic[Worker]):
    """The steps in progress on one core (set of cores) and the work each has left, in seconds alone."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.left: dict[Worker, float] = {}
        self.version: dict[Worker, int] = {}
        self.last = 0.0

    def _advance(self, now: float) -> None:
        if self.left:
            done = (now - self.last) / len(self.left)
            for w in self.left:
                self.left[w] -= done
        self.last = now

    def _ends(self, now: float) -> list[tuple[Worker, int, float]]:
        """(worker, version, end time) of every step in progress, at the current sharing."""
        k = len(self.left)
        out = []
        for w, left in self.left.items():
            self.version[w] = self.version.get(w, 0) + 1
            out.append((w, self.version[w], now + max(0.0, left) * k))
        return out

    def start(self, w: Worker, seconds: float, now: float) -> list[tuple[Worker, int, float]]:
        """Worker `w` starts a step of `seconds` alone: the new end times of every step on this core."""
        self._advance(now)
        self.left[w] = seconds
        return self._ends(now)

    def end(self, w: Worker, now: float) -> list[tuple[Worker, int, float]]:
        """Worker `w`'s step ended: the others speed up."""
        self._advance(now)
        del self.left[w]
        return self._ends(now)

    def current(self, w: Worker, version: int) -> bool:
        """Whether an end event of `w` with this version is still the right one (not re-timed since)."""
        return self.version.get(w) == version


def core_groups(affinities: dict[str, tuple[int, ...]]) -> dict[str, SharedCore[Any]]:
    """Worker name → its SharedCore, for workers whose cores another worker is pinned to as well."""
    by_cores: dict[tuple[int, ...], list[str]] = {}
    for name, cores in affinities.items():
        if cores:
            by_cores.setdefault(tuple(sorted(cores)), []).append(name)
    out = {}
    for cores, names in by_cores.items():
        if len(names) > 1:
            core: SharedCore[Any] = SharedCore(",".join(map(str, cores)))
            out.update({n: core for n in names})
    return out
