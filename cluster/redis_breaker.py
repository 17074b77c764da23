"""A circuit breaker in front of one process's Redis calls: a slow or full Redis costs a few calls, not every one.

States (as in resilience4j / Envoy outlier detection):
1. closed: calls go through; each failure (timeout, refused connection, OOM under `maxmemory`, any Redis error) or
   slow answer (over `slow_s`) counts; `threshold` of them in a row open the breaker;
2. open: for `cooldown_s` every call fails at once with `RedisUnavailable` (callers already handle a Redis error:
   the router routes on load alone, a worker resyncs when Redis is back), so no thread waits for a socket timeout;
3. half-open: after the cooldown one call probes Redis; success closes the breaker, failure opens it again.

Each change of state is logged once (WARNING on open, naming the last failure; ERROR when Redis is full, since
then heartbeats expire and the workers look dead); the breaker is a Prometheus collector:
`pdcluster_redis_breaker_open` (0/1), `pdcluster_redis_errors_total{kind}` (kind: timeout, connection, full,
error, slow) and `pdcluster_redis_rejected_total` (calls failed fast while open), each labelled `client`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

log = logging.getLogger(__name__)
T = TypeVar("T")
KINDS = ("timeout", "connection", "full", "error", "slow")


class RedisUnavailable(redis.exceptions.ConnectionError):
    """The breaker is open: Redis was failing or slow, so this call was not sent."""


def kind_of(exc: BaseException) -> str:
    """The error kind counted for `exc`: timeout, connection, full (maxmemory) or error."""
    if isinstance(exc, (redis.exceptions.TimeoutError, TimeoutError)):
        return "timeout"
    if isinstance(exc, (redis.exceptions.ConnectionError, OSError)):
        return "connection"
    # NOTE: redis-py raises a plain ResponseError for "OOM command not allowed when used memory > 'maxmemory'"
    if "OOM" in str(exc) or isinstance(exc, getattr(redis.exceptions, "OutOfMemoryError", ())):
        return "full"
    return "error"


class RedisBreaker:
    """Closed → open after `threshold` failed or slow calls in a row → half-open after `cooldown_s` (see above)."""

    def __init__(self, client_name: str, *, threshold: int = 3, slow_s: float = 0.5, cooldown_s: float = 2.0) -> None:
        self.client_name = client_name
        self.threshold, self.slow_s, self.cooldown_s = threshold, slow_s, cooldown_s
        self.state = "closed"
        self.errors = dict.fromkeys(KINDS, 0)
        self.opened = 0  # times the breaker opened
        self.rejected = 0  # calls failed fast while open
        self._in_a_row = 0
        self._reopen_at = 0.0
        self._probing = False
        self._last = ""
        self._lock = threading.Lock()

    def call(self, fn: Callable[[], T]) -> T:
        """`fn()` through the breaker; raises RedisUnavailable without calling it while open."""
        with self._lock:
            if self.state == "open" or (self.state == "half-open" and self._probing):
                if self.state == "open" and time.monotonic() >= self._reopen_at:
                    self.state = "half-open"  # NOTE: this call is the probe
                else:
                    self.rejected += 1
                    raise RedisUnavailable(f"Redis breaker open ({self._last}); retrying in "
                                           f"{max(0.0, self._reopen_at - time.monotonic()):.1f} s")
            self._probing = self.state == "half-open"
        started = time.monotonic()
        try:
            out = fn()
        except (redis.RedisError, OSError) as e:
            self._failed(kind_of(e), f"{kind_of(e)}: {e}")
            raise
        elapsed = time.monotonic() - started
        if elapsed > self.slow_s:
            self._failed("slow", f"slow: a call took {elapsed:.2f} s (> {self.slow_s} s)")
        else:
            self._succeeded()
        return out

    def _failed(self, kind: str, what: str) -> None:
        with self._lock:
            self.errors[kind] += 1
            self._in_a_row += 1
            self._last = what
            was, self._probing = self.state, False
            if self.state == "half-open" or (self.state == "closed" and self._in_a_row >= self.threshold):
                self.state, self._reopen_at = "open", time.monotonic() + self.cooldown_s
                if was == "closed":
                    self.opened += 1
        if was == "closed" and self.state == "open":
            if kind == "full":
                log.error("%s: Redis is full (maxmemory): writes are refused, so heartbeats expire, workers look "
                          "dead and prefix routing is off; raise maxmemory or free it. Failing fast for %.0f s (%s)",
                          self.client_name, self.cooldown_s, what)
            else:
                log.warning("%s: Redis breaker open after %d failed or slow calls in a row; failing fast for %.0f s "
                            "(last: %s)", self.client_name, self._in_a_row, self.cooldown_s, what)

    def _succeeded(self) -> None:
        with self._lock:
            was, self.state, self._in_a_row, self._probing = self.state, "closed", 0, False
        if was != "closed":
            log.warning("%s: Redis breaker closed: Redis answers again", self.client_name)

    # ---- Prometheus (a custom collector: register it on a CollectorRegistry) ----
    def describe(self) -> Iterator[Metric]:
        return self.collect()

    def collect(self) -> Iterator[Metric]:
        labels = ["client"]
        gauge = GaugeMetricFamily("pdcluster_redis_breaker_open", "1 while calls to Redis fail fast (breaker open "
                                  "or half-open), else 0.", labels=labels)
        gauge.add_metric([self.client_name], 0.0 if self.state == "closed" else 1.0)
        errors = CounterMetricFamily("pdcluster_redis_errors", "Failed or slow Redis calls, by kind (timeout, "
                                     "connection, full, error, slow).", labels=["client", "kind"])
        for kind, n in self.errors.items():
            errors.add_metric([self.client_name, kind], float(n))
        rejected = CounterMetricFamily("pdcluster_redis_rejected", "Redis calls failed fast while the breaker was "
                                       "open.", labels=labels)
        rejected.add_metric([self.client_name], float(self.rejected))
        yield from (gauge, errors, rejected)
