"""A circuit breaker per worker: a worker that failed a request is avoided at once, then tried again now and then.

States (as in Envoy's outlier detection and resilience4j's breaker):
1. closed: the worker takes requests;
2. open: it failed (`failed()`); no request goes there for `cooldown_s`, which doubles with each failure in a row
   (BREAKER_MAX_S at most);
3. half-open: the cooldown is over; the next request that picks it is its probe (`picked()` re-arms the cooldown,
   so at most one probe runs per cooldown and a probe that never reports cannot keep the worker out for good);
   a success (`succeeded()`) closes the breaker, a failure opens it again for twice as long.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

BREAKER_BASE_S = 2.0  # the first cooldown after a failure
BREAKER_MAX_S = 30.0  # cooldowns double up to this


@dataclass(slots=True)
class Breaker:
    """One worker's breaker (times are time.monotonic())."""

    failures: int = 0  # failures in a row; 0: closed
    open_until: float = 0.0  # no request before this

    def available(self, now: float | None = None) -> bool:
        """Whether a request may go to the worker now (closed, or half-open: its cooldown is over)."""
        return self.failures == 0 or (now if now is not None else time.monotonic()) >= self.open_until

    def picked(self, now: float | None = None) -> None:
        """A request was sent there: in half-open state it is the probe, so the next one waits a cooldown."""
        if self.failures:
            self.open_until = (now if now is not None else time.monotonic()) + self.cooldown_s()

    def failed(self, now: float | None = None) -> None:
        """The worker failed a request: open (again), for twice as long as the last time."""
        self.failures += 1
        self.open_until = (now if now is not None else time.monotonic()) + self.cooldown_s()

    def succeeded(self) -> None:
        """The worker served a request: closed."""
        self.failures, self.open_until = 0, 0.0

    def cooldown_s(self) -> float:
        return min(BREAKER_MAX_S, BREAKER_BASE_S * 2 ** max(0, self.failures - 1))
