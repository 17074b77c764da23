"""A simulated run's figures, with the definitions `pdcluster bench serve` uses (pdcluster/bench/stats.py).

TTFT: sent → first token at the client; ITL: gaps between successive tokens at the client, percentiles over all
gaps of all requests; TPOT per request: (e2e − TTFT) / (output tokens − 1); SLO attainment: share of requests with
TTFT ≤ the TTFT SLO and TPOT ≤ the ITL SLO (DistServe); a request that never finished misses it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from pdcluster.bench.stats import dist
from pdcluster.plan.sim_worker import Req
from pdcluster.plan.simulator import Simulator


class Timings:
    """Per-request client-side times of a finished simulation (ms)."""

    def __init__(self, sim: Simulator) -> None:
        self.sim = sim
        self.ends = {w.name: np.asarray(w.step_ends) for w in sim.workers}
        self.done = [r for r in sim.reqs if r.t_last > 0]

    def gaps_ms(self, r: Req) -> np.ndarray:
        """Inter-token gaps of one request as its client sees them."""
        if r.max_tokens < 2:
            return np.zeros(0)
        assert r.decode is not None
        times = self.ends[r.decode.name][r.dec_step:r.dec_step + r.max_tokens - 1] + self.sim.ov.token_s
        return np.diff(np.concatenate(([r.t_first], times))) * 1e3

    def records(self) -> list[dict[str, Any]]:
        """One dict per request, in the bench's record format."""
        out = []
        for r in self.sim.reqs:
            ok = r.t_last > 0
            out.append({"session": r.session, "turn": r.turn, "sent_s": round(r.sent, 4),
                        "prompt_len": r.prompt_len, "output_len": r.max_tokens if ok else 0,
                        "ttft_ms": round((r.t_first - r.sent) * 1e3, 2) if ok else 0.0,
                        "itl_ms": [round(float(g), 2) for g in self.gaps_ms(r)] if ok else [],
                        "e2e_ms": round((r.t_last - r.sent) * 1e3, 2) if ok else 0.0,
                        "cached_tokens": r.cached_tokens, "transfer_ms": round(r.transfer_s * 1e3, 2),
                        "prefill_worker": r.prefill.name if r.prefill else "",
                        "decode_worker": r.decode.name if r.decode else "", "prefill_skipped": r.skipped,
                        "placement": r.placement,
                        "error": None if ok else "UNFINISHED: still queued when the simulation ran out of events"})
        return out

    def summary(self, slo_ttft_ms: float, slo_itl_ms: float) -> dict[str, Any]:
        """The bench's summary figures for this simulated run."""
        done = self.done
        ttft = np.array([(r.t_first - r.sent) * 1e3 for r in done])
        e2e = np.array([(r.t_last - r.sent) * 1e3 for r in done])
        n_out = np.array([r.max_tokens for r in done])
        multi = n_out > 1
        tpot = np.zeros(len(done))
        tpot[multi] = (e2e[multi] - ttft[multi]) / (n_out[multi] - 1)
        gaps = [self.gaps_ms(r) for r in done]
        itl = np.concatenate(gaps) if gaps else np.zeros(0)
        elapsed = max((r.t_last for r in done), default=0.0)
        prompt = sum(r.prompt_len for r in done)
        meets = int(np.sum((ttft <= slo_ttft_ms) & (tpot <= slo_itl_ms)))
        total = len(self.sim.reqs)
        return {
            "completed": len(done), "failed": total - len(done), "duration_s": round(elapsed, 2),
            "req_per_s": round(len(done) / elapsed, 3) if elapsed else 0.0,
            "output_tok_per_s": round(float(n_out.sum()) / elapsed, 1) if elapsed else 0.0,
            "ttft_ms": dist(ttft), "itl_ms": dist(itl), "tpot_ms": dist(tpot[multi]), "e2e_ms": dist(e2e),
            "transfer_ms": dist([r.transfer_s * 1e3 for r in done if r.prefill is not None]),
            "prefix_hit_rate": round(sum(r.cached_tokens for r in done) / prompt, 3) if prompt else 0.0,
            "prefill_skipped": sum(r.skipped for r in done),
            "placements": dict(Counter(r.placement for r in done)),
            "slo_attainment": round(meets / total, 3) if total else 0.0,
            "sim": {"workers": len(self.sim.workers), "events": self.sim.num_events,
                    "wall_s": round(self.sim.wall_s, 3),
                    "kv_overflow_blocks": sum(w.overflow_blocks for w in self.sim.workers)},
        }
