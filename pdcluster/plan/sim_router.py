"""The simulated router: the real `router.policy.Policy` deciding over simulated workers.

The policy is the router's own code, so prefix-aware routing, round robin and the skip-prefill rule are mirrored by
construction. It sees what one router sees: its own in-flight counts and pending prefill tokens, each worker's
heartbeat load (queues and the step cost it measured, `sim_load.SimLoad`: exact, where the real one is up to ~0.75 s
old), free blocks, and an exact prefix index. With `slo_itl_ms` the policy's SLO placements follow (prompt chunks
on the decode pool, a request that stays on its prefill worker).

Scale: the policy scans the workers it is given. Pools of up to EXACT_POOL workers get all of them (the real
router's choice exactly); larger pools get candidates: the CANDIDATES least loaded (a lazy heap per pool, O(log n) per
load change) plus the worker that last stored the deepest cached block of the prompt (a per-pool index of block
key → worker). A worker at a middle depth and a middle load, or a second holder of the deepest block, is what this
can miss.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from pdcluster.plan.sim_worker import Req, Worker
from router.policy import Policy, Route, WorkerView

EXACT_POOL = 64
CANDIDATES = 4


class SimView(WorkerView):
    """A WorkerView whose free blocks are read from the simulated worker itself, its load refreshed from it
    (sim_load.py) whenever the policy is given the view."""

    worker: Worker

    def free_blocks(self) -> float:
        return float(self.worker.cache.num_free)


class Pool:
    """The workers of one role, their router views, a load heap and a prefix index (block key → workers)."""

    def __init__(self, workers: Sequence[Worker], speed_tok_s: float, prefill_role: bool) -> None:
        self.workers = list(workers)
        self.views: list[SimView] = []
        for w in self.workers:
            v = SimView(w.name, w.cache.num_blocks, w.max_seqs, prefill_tok_s=speed_tok_s)
            v.worker, v.load = w, w.measured.load
            self.views.append(v)
        self.prefill_role = prefill_role
        self.index: dict[int, int] = {}  # block key -> the worker that last stored it (large pools only)
        if len(self.workers) > EXACT_POOL:
            for i, w in enumerate(self.workers):
                w.cache.index, w.cache.owner = self.index, i
        self._count = itertools.count()
        self._stamp = [0] * len(self.workers)
        self._heap: list[tuple[int, int, int, int]] = []
        for i in range(len(self.workers)):
            self.touch(i)

    def _load(self, i: int) -> tuple[int, int]:
        v = self.views[i]
        return (v.pending_tokens, v.inflight) if self.prefill_role else (v.inflight, 0)

    def touch(self, i: int) -> None:
        """Worker i's load changed: push its new key (older entries become stale)."""
        stamp = next(self._count)
        self._stamp[i] = stamp
        heapq.heappush(self._heap, (*self._load(i), stamp, i))

    def least_loaded(self, k: int) -> list[int]:
        """The k least loaded workers (ties: the one whose load changed longest ago first)."""
        out: list[tuple[int, int, int, int]] = []
        heap = self._heap
        while heap and len(out) < k:
            e = heapq.heappop(heap)
            if self._stamp[e[3]] == e[2]:
                out.append(e)
        for e in out:
            heapq.heappush(heap, e)
        return [e[3] for e in out]

    def deepest_holder(self, keys: Sequence[int]) -> list[int]:
        """The worker that last stored the deepest block of `keys` any worker caches (none: [])."""
        lo, hi = 0, len(keys)  # NOTE: binary search: a worker holding block i nearly always holds 0..i-1 too
        while lo < hi:
            mid = (lo + hi) // 2
            if keys[mid] in self.index:
                lo = mid + 1
            else:
                hi = mid
        return [self.index[keys[lo - 1]]] if lo else []

    def candidates(self, keys: Sequence[int]) -> tuple[list[WorkerView], dict[str, int]]:
        """The views the policy chooses among and how many leading prompt blocks each caches."""
        if len(self.workers) <= EXACT_POOL:
            idx: Sequence[int] = range(len(self.workers))
        else:
            idx = list(dict.fromkeys(self.least_loaded(CANDIDATES) + self.deepest_holder(keys)))
        views: list[WorkerView] = []
        matched: dict[str, int] = {}
        for i in idx:
            v = self.views[i]
            v.load = self.workers[i].measured.refresh()  # NOTE: as a heartbeat read now
            views.append(v)
            d = self.workers[i].cache.depth(keys)
            if d:
                matched[self.workers[i].name] = d
        return views, matched


class SimRouter:
    """Routes each request with the real policy; keeps the per-router counts the policy reads."""

    def __init__(self, policy: Policy, prefill: Pool | None, decode: Pool) -> None:
        self.policy = policy
        self.routing = policy.routing
        self.prefill, self.decode = prefill, decode
        self.by_name = {w.name: (pool, i) for pool in (prefill, decode) if pool
                        for i, w in enumerate(pool.workers)}
        self._all_prefill: list[WorkerView] = list(prefill.views) if prefill else []
        self._all_decode: list[WorkerView] = list(decode.views)

    def route(self, req: Req) -> Route:
        if self.routing == "round_robin":
            # NOTE: round robin never reads matches or loads: the full lists cost nothing (only indexed)
            return self.policy.route(req.prompt_len, req.max_tokens, {}, self._all_prefill, self._all_decode)
        matched: dict[str, int] = {}
        pv: list[WorkerView] = []
        if self.prefill is not None:
            pv, matched = self.prefill.candidates(req.keys)
        dv, dm = self.decode.candidates(req.keys)
        return self.policy.route(req.prompt_len, req.max_tokens, matched | dm, pv, dv)

    def worker(self, name: str) -> Worker:
        pool, i = self.by_name[name]
        return pool.workers[i]

    def change(self, w: Worker, *, inflight: int = 0, pending: int = 0) -> None:
        """Add to a worker's in-flight count and pending prefill tokens (as the router's flow does)."""
        pool, i = self.by_name[w.name]
        v = pool.views[i]
        v.inflight += inflight
        v.pending_tokens += pending
        pool.touch(i)
