"""Per-request leases on a worker: a request that no live router renewed for a lease period is aborted.

Life of a lease:
1. each router's LeaseKeeper (router/leases.py) sends every worker, four times per period, one `renew` with the ids
   of all the requests it has in flight (one call per worker, not one per request) and the period;
2. the first renewal turns leases on for this worker: a worker that no router renews (unit tests, direct calls to
   an actor) expires nothing;
3. a request the worker runs is covered from when the worker first sees it, then by each renewal of its id, or of
   the router's request id it is an attempt of (`{request_id}~{attempt}`, router/flow.py);
4. `expired(running)` names the requests past the period: the worker aborts them, freeing their KV blocks.
NOTE: a router killed with `kill -9` (or cut off from the workers) renews nothing, so its requests are aborted one
period later instead of generating into a stream nobody reads, holding blocks, until `max_tokens`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable


def _base(request_id: str) -> str:
    """The router's request id of an attempt id (`{request_id}~{attempt}`); the id itself otherwise."""
    return request_id.rsplit("~", 1)[0]


class RequestLeases:
    """Which running requests a live router still wants (plain class; the worker's publisher thread asks)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lease_s: float | None = None  # None until a router renewed: then leases are on
        self._renewed: dict[str, float] = {}  # request id → last renewal (monotonic)
        self._seen: dict[str, float] = {}  # running request id → when `expired` first saw it

    def renew(self, request_ids: Iterable[str], lease_s: float, now: float | None = None) -> None:
        """A router still wants these requests (its ids; their attempts are covered too) for `lease_s` more."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self.lease_s = lease_s
            for rid in request_ids:
                self._renewed[rid] = now

    def expired(self, running: Iterable[str], now: float | None = None) -> list[str]:
        """The requests of `running` whose lease ran out (empty while leases are off)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self.lease_s is None:
                return []
            seen, out = {}, []
            for rid in running:
                seen[rid] = first = self._seen.get(rid, now)
                last = max(first, self._renewed.get(rid, 0.0), self._renewed.get(_base(rid), 0.0))
                if now - last > self.lease_s:
                    out.append(rid)
            self._seen = seen  # NOTE: only requests still running are remembered
            stale = now - 2 * self.lease_s
            self._renewed = {rid: t for rid, t in self._renewed.items() if t >= stale}
            return out
