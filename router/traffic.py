"""The router's live traffic over a sliding window: what an autoscaler reads (read-only to anyone but the router).

The router calls `arrived` when a request comes in (before admission: a refused request was demand too), and
`finished` or `failed` when it ends. `snapshot(window_s)` sums the window: arrival rate, mean prompt and output
lengths (the lengths asked for, at arrival, so a shift in traffic shows before the new requests finish), and SLO
attainment over the requests that ended in the window (a failed or refused request misses).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

KEEP_S = 900.0  # records older than this are dropped (no window is longer)


@dataclass(frozen=True, slots=True)
class TrafficSnapshot:
    """The window's figures; lengths are token counts, `attainment` None when nothing ended in it."""

    window_s: float
    arrivals: int
    rate: float  # requests per second
    prompt_lens: tuple[int, ...]  # of the arrivals, oldest first
    output_lens: tuple[int, ...]  # max_tokens of the arrivals
    ended: int
    met: int  # ended requests with TTFT <= slo_ttft_ms and TPOT <= slo_itl_ms
    attainment: float | None

    @property
    def prompt_mean(self) -> float:
        return sum(self.prompt_lens) / len(self.prompt_lens) if self.prompt_lens else 0.0

    @property
    def output_mean(self) -> float:
        return sum(self.output_lens) / len(self.output_lens) if self.output_lens else 0.0


class TrafficWindow:
    """Arrivals and endings with their times (monotonic seconds); the router writes, an autoscaler reads."""

    def __init__(self, slo_ttft_ms: float, slo_itl_ms: float | None) -> None:
        self.slo_ttft_ms, self.slo_itl_ms = slo_ttft_ms, slo_itl_ms
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (t, prompt tokens, max_tokens)
        self._ended: deque[tuple[float, bool]] = deque()  # (t, met both SLOs)

    def arrived(self, prompt_tokens: int, max_tokens: int, now: float | None = None) -> None:
        t = time.monotonic() if now is None else now
        self._arrivals.append((t, prompt_tokens, max_tokens))
        self._trim(t)

    def finished(self, ttft_s: float | None, tpot_s: float | None, now: float | None = None) -> None:
        """A request that ended with its answer; `tpot_s` None for an answer of one token."""
        ok = ttft_s is not None and ttft_s * 1e3 <= self.slo_ttft_ms
        if ok and tpot_s is not None and self.slo_itl_ms is not None:
            ok = tpot_s * 1e3 <= self.slo_itl_ms
        self._ended.append((time.monotonic() if now is None else now, ok))

    def failed(self, now: float | None = None) -> None:
        """A request that ended without its answer (refused, failed, timed out): a miss."""
        self._ended.append((time.monotonic() if now is None else now, False))

    def _trim(self, now: float) -> None:
        for q in (self._arrivals, self._ended):
            while q and q[0][0] < now - KEEP_S:
                q.popleft()

    def snapshot(self, window_s: float, now: float | None = None) -> TrafficSnapshot:
        """The figures of the last `window_s` seconds."""
        t = time.monotonic() if now is None else now
        self._trim(t)
        arr = [a for a in self._arrivals if a[0] >= t - window_s]
        ended = [ok for e, ok in self._ended if e >= t - window_s]
        met = sum(ended)
        return TrafficSnapshot(window_s, len(arr), len(arr) / window_s, tuple(a[1] for a in arr),
                               tuple(a[2] for a in arr), len(ended), met, met / len(ended) if ended else None)
