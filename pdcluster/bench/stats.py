"""The figures of a serving run, with the definitions vLLM's and DistServe's benchmarks use.

- TTFT: request sent → first token received by the client.
- ITL: gaps between successive tokens as the client receives them; percentiles over all gaps of all requests.
- TPOT (per request): (e2e − TTFT) / (output tokens − 1), the mean inter-token latency of one request.
- SLO attainment: share of requests with TTFT ≤ the TTFT SLO and the request's inter-token figure ≤ the ITL SLO;
  failed requests count as missing it. The figure is TPOT by default (DistServe), or the request's p90 gap
  (`Slo.itl_stat="p90"`: a request whose answer stalls now and then misses it even when its mean is low).
- Goodput: the highest request rate whose attainment is ≥ 90% (DistServe); from a sweep over rates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestRecord:
    """What the client saw of one request (times in ms; `sent_s` since the run started)."""

    session: int
    turn: int
    sent_s: float
    prompt_len: int
    max_tokens: int
    output_len: int = 0
    ttft_ms: float = 0.0
    itl_ms: list[float] = field(default_factory=list)
    e2e_ms: float = 0.0
    cached_tokens: int = 0
    transfer_ms: float = 0.0
    prefill_worker: str = ""
    decode_worker: str = ""
    prefill_skipped: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["itl_ms"] = [round(x, 2) for x in self.itl_ms]
        return d


GOODPUT_ATTAINMENT = 0.9


ITL_STATS = ("mean", "p90")


@dataclass(frozen=True)
class Slo:
    """The latency objectives a request must meet (ms)."""

    ttft_ms: float
    itl_ms: float
    itl_stat: str = "mean"  # the request's figure held to itl_ms: "mean" (TPOT) or "p90" (its p90 gap)

    def __post_init__(self) -> None:
        if self.itl_stat not in ITL_STATS:
            raise ValueError(f"--slo-itl-stat: expected one of {list(ITL_STATS)}, got {self.itl_stat!r}")


def dist(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """mean, p50, p90, p99 (linear interpolation, as numpy and vLLM's benchmark); zeros when empty."""
    a = np.asarray(values, dtype=float)
    if a.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": round(float(a.mean()), 2), "p50": round(float(p50), 2), "p90": round(float(p90), 2),
            "p99": round(float(p99), 2)}


def tpot_ms(r: RequestRecord) -> float:
    return (r.e2e_ms - r.ttft_ms) / (r.output_len - 1) if r.output_len > 1 else 0.0


def request_itl_ms(r: RequestRecord, stat: str) -> float:
    """A request's inter-token figure: its TPOT ("mean") or the p90 of its gaps ("p90"); 0 with under 2 tokens."""
    if stat == "p90":
        return float(np.percentile(r.itl_ms, 90)) if r.itl_ms else 0.0
    return tpot_ms(r)


def meets(r: RequestRecord, slo: Slo) -> bool:
    return r.ok and r.ttft_ms <= slo.ttft_ms and request_itl_ms(r, slo.itl_stat) <= slo.itl_ms


def summarize(records: Sequence[RequestRecord], elapsed_s: float, slo: Slo) -> dict[str, Any]:
    """The summary figures of one run."""
    ok = [r for r in records if r.ok]
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            code = r.error.split(":", 1)[0]
            errors[code] = errors.get(code, 0) + 1
    prompt = sum(r.prompt_len for r in ok)
    transfers = [r.transfer_ms for r in ok if r.prefill_worker]
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "errors": errors,
        "duration_s": round(elapsed_s, 2),
        "req_per_s": round(len(ok) / elapsed_s, 3) if elapsed_s else 0.0,
        "output_tok_per_s": round(sum(r.output_len for r in ok) / elapsed_s, 1) if elapsed_s else 0.0,
        "ttft_ms": dist([r.ttft_ms for r in ok]),
        "itl_ms": dist([g for r in ok for g in r.itl_ms]),
        "tpot_ms": dist([tpot_ms(r) for r in ok if r.output_len > 1]),
        "e2e_ms": dist([r.e2e_ms for r in ok]),
        "transfer_ms": dist(transfers),
        "prefix_hit_rate": round(sum(r.cached_tokens for r in ok) / prompt, 3) if prompt else 0.0,
        "prefill_skipped": sum(r.prefill_skipped for r in ok),
        "slo_attainment": round(sum(meets(r, slo) for r in records) / len(records), 3) if records else 0.0,
        "slo_attainment_per_minute": per_minute(records, slo),
    }


def per_minute(records: Sequence[RequestRecord], slo: Slo, bucket_s: float = 60.0) -> list[dict[str, Any]]:
    """SLO attainment of the requests sent in each minute of the run (bucketed by when they were sent)."""
    by: dict[int, list[bool]] = {}
    for r in records:
        by.setdefault(int(r.sent_s // bucket_s), []).append(meets(r, slo))
    return [{"minute": m, "requests": len(v), "slo_attainment": round(sum(v) / len(v), 3)}
            for m, v in sorted(by.items())]


def goodput(points: Sequence[tuple[float, float]], target: float = GOODPUT_ATTAINMENT) -> dict[str, float | None]:
    """From (rate, attainment) points: the highest measured rate meeting `target`, and a linear estimate of where
    attainment crosses it between that rate and the next one (None when no rate meets it)."""
    pts = sorted(points)
    best = None
    estimate = None
    for i, (rate, att) in enumerate(pts):
        if att >= target:
            best = rate
            estimate = rate
            if i + 1 < len(pts) and pts[i + 1][1] < target:
                r2, a2 = pts[i + 1]
                estimate = rate + (att - target) / (att - a2) * (r2 - rate)
        elif best is not None:
            break
    return {"goodput_req_per_s": best,
            "goodput_estimate_req_per_s": round(estimate, 3) if estimate is not None else None}
