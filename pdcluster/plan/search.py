"""The cheapest prefill:decode split that meets the SLOs at a target rate, found in the simulator.

A split is feasible when its SLO attainment (share of requests with TTFT ≤ the TTFT SLO and TPOT ≤ the ITL SLO:
DistServe's goodput definition) is at least the target. The search assumes more workers never hurt:
1. lower bounds from capacity: prefill work and decode work per second over one worker's speed;
2. the fewest prefill workers whose TTFTs meet the SLO with decode generously sized, and the fewest decode
   workers whose TPOTs meet it with prefill generously sized (doubling, then bisection);
3. if that corner misses the joint SLO: the fewest extra prefill (or decode) workers that make it meet it, an upper
   bound; then splits from the corner in order of cost (GPUs), at most MAX_WALK of them, until none is cheaper
   than the best found; among feasible splits of one cost, the best attainment wins.
Colocated workers with the same GPUs are simulated for comparison, and the fewest colocated workers that meet it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pdcluster.bench.workloads import Workload
from pdcluster.plan.profile import Profile
from pdcluster.plan.sim_report import Timings
from pdcluster.plan.simulator import ClusterShape, Overheads, Simulator

MAX_WALK = 24  # splits tried in step 3's walk at most


class Slo(BaseModel):
    """Latency objectives and the share of requests that must meet both."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float = Field(gt=0)
    itl_ms: float = Field(gt=0)
    attainment: float = Field(default=0.9, gt=0, le=1)


@dataclass
class Trial:
    """One simulated split and how it did."""

    prefill: int
    decode: int
    gpus: int
    attainment: float
    ttft_ok: float  # share of requests meeting the TTFT SLO alone
    tpot_ok: float
    summary: dict[str, Any] = field(repr=False, default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.decode, "gpus": self.gpus, "attainment": self.attainment,
                "ttft_ok": self.ttft_ok, "tpot_ok": self.tpot_ok, "summary": self.summary}


class Planner:
    """Simulates splits of one disaggregated shape (and its colocated twin) on one workload; memoised."""

    def __init__(self, shape: ClusterShape, colocated: ClusterShape | None, profile: Profile, overheads: Overheads,
                 workload: Workload, slo: Slo, max_gpus: int, log: Callable[[str], None] = lambda m: None) -> None:
        self.shape, self.colocated = shape, colocated
        self.profile, self.ov, self.wl, self.slo = profile, overheads, workload, slo
        self.per = profile.gpus_per_worker
        self.max_workers = max(2, max_gpus // self.per)
        self.log = log
        self.trials: dict[tuple[str, int, int], Trial] = {}

    def run(self, prefill: int, decode: int, mode: str = "disaggregated") -> Trial:
        """Simulate `prefill`+`decode` workers (colocated: `decode` workers, prefill 0)."""
        key = (mode, prefill, decode)
        if key in self.trials:
            return self.trials[key]
        if mode == "colocated":
            assert self.colocated is not None
            shape = self.colocated.with_replicas(colocated=decode)
        else:
            shape = self.shape.with_replicas(prefill=prefill, decode=decode)
        sim = Simulator(shape, self.profile, self.ov)
        sim.run(self.wl)
        t = Timings(sim)
        s = t.summary(self.slo.ttft_ms, self.slo.itl_ms)
        n = max(1, len(sim.reqs))
        ttft_ok = sum((r.t_first - r.sent) * 1e3 <= self.slo.ttft_ms for r in t.done) / n
        tpot_ok = sum(r.max_tokens < 2 or (r.t_last - r.t_first) * 1e3 / (r.max_tokens - 1) <= self.slo.itl_ms
                      for r in t.done) / n
        trial = Trial(prefill, decode, (prefill + decode) * self.per, s["slo_attainment"], round(ttft_ok, 3),
                      round(tpot_ok, 3), s)
        self.trials[key] = trial
        self.log(f"{mode} {prefill}P:{decode}D ({trial.gpus} GPUs): attainment {trial.attainment:.3f} (TTFT ok "
                 f"{trial.ttft_ok:.3f}, TPOT ok {trial.tpot_ok:.3f}), sim {sim.wall_s:.2f} s")
        return trial

    def ok(self, t: Trial) -> bool:
        return t.attainment >= self.slo.attainment

    def lower_bounds(self) -> tuple[int, int]:
        """Workers the work alone needs: prefill and decode seconds per second of load, at the best batching.

        NOTE: a prompt's own share of a full step (no fixed cost, no knee: other prompts fill the step) for prefill;
        a full batch of max_num_seqs for decode.
        """
        step = self.profile.step
        reqs = [(s.prompt_len(i), t.max_tokens) for s in self.wl.sessions for i, t in enumerate(s.turns)]
        pre = sum(step.c_tok_s * n + step.c_seq_s + step.c_pre_pair_s * n * (n + 1) / 2 for n, _ in reqs) / len(reqs)
        ps = self.shape.pools.get("decode") or next(iter(self.shape.pools.values()))
        ctx = sum(n + m / 2 for n, m in reqs) / len(reqs)
        tok_s = ps.max_num_seqs / step.decode_time(ps.max_num_seqs, int(ctx))
        out = sum(m for _, m in reqs) / len(reqs)
        return max(1, math.ceil(self.wl.rate * pre)), max(1, math.ceil(self.wl.rate * out / tok_s))

    def _smallest(self, lo: int, hi: int, good: Callable[[int], bool]) -> int | None:
        """Smallest n in [lo, hi] with good(n) (monotone): doubling from lo, then bisection."""
        n = lo
        while not good(n):
            if n >= hi:
                return None
            lo, n = n + 1, min(hi, n * 2)
        while lo < n:
            mid = (lo + n) // 2
            if good(mid):
                n = mid
            else:
                lo = mid + 1
        return n

    def cheapest(self) -> Trial | None:
        """The feasible disaggregated split with the fewest GPUs (ties: best attainment), or None."""
        p_lb, d_lb = self.lower_bounds()
        cap = self.max_workers
        if p_lb + d_lb > cap:
            self.log(f"capacity alone needs {p_lb}P + {d_lb}D workers, more than --max-gpus allows")
            return None
        d_gen = max(d_lb, min(cap - p_lb, 2 * d_lb + 1))
        p_min = self._smallest(p_lb, cap - d_gen, lambda p: self.run(p, d_gen).ttft_ok >= self.slo.attainment)
        if p_min is None:
            return None
        p_gen = max(p_min, min(cap - d_lb, 2 * p_min + 1))
        d_min = self._smallest(d_lb, cap - p_gen, lambda d: self.run(p_gen, d).tpot_ok >= self.slo.attainment)
        if d_min is None:
            return None
        best: Trial | None = None
        if not self.ok(self.run(p_min, d_min)):
            # NOTE: the corner meets each SLO alone but not both: grow one side, then the other, for an upper bound
            more_p = self._smallest(p_min, cap - d_min, lambda p: self.ok(self.run(p, d_min)))
            more_d = self._smallest(d_min, cap - p_min, lambda d: self.ok(self.run(p_min, d)))
            grown = ([self.run(more_p, d_min)] if more_p else []) + ([self.run(p_min, more_d)] if more_d else [])
            best = min(grown, key=lambda t: (t.gpus, -t.attainment), default=None)
        frontier = [(p_min + d_min, p_min, d_min)]
        seen = {(p_min, d_min)}
        for _ in range(MAX_WALK):  # NOTE: cheapest first from the corner: exact unless it runs out of steps
            if not frontier:
                break
            total, p, d = heapq.heappop(frontier)
            if best is not None and total * self.per > best.gpus:
                break
            t = self.run(p, d)
            if self.ok(t):
                if best is None or (t.gpus, -t.attainment) < (best.gpus, -best.attainment):
                    best = t
                continue
            for nxt in ((p + 1, d), (p, d + 1)):
                if nxt not in seen and sum(nxt) <= cap:
                    seen.add(nxt)
                    heapq.heappush(frontier, (sum(nxt), *nxt))
        return best

    def colocated_for(self, workers: int) -> tuple[Trial | None, Trial | None]:
        """Colocated with the same workers, and the fewest colocated workers that meet the SLO (if any)."""
        if self.colocated is None:
            return None, None
        same = self.run(0, workers, "colocated")
        lo = min(self.max_workers, self.lower_bounds()[1])  # NOTE: colocated decodes the same tokens
        fewest_n = self._smallest(lo, self.max_workers, lambda n: self.ok(self.run(0, n, "colocated")))
        return same, (self.run(0, fewest_n, "colocated") if fewest_n else None)
