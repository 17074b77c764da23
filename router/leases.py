"""`LeaseKeeper`: the router renews the lease of every request it has in flight, one call per worker per interval.

Life of the keeper:
1. the Router `hold`s a request id at admission and `release`s it when the request ends (router/core.py);
2. every `lease_s / RENEWALS_PER_LEASE` the keeper sends each worker of the pools one `renew_leases(ids, lease_s)`
   with all the ids held (a worker ignores those it does not run; attempts `{id}~{n}` are covered by their id);
3. a worker aborts a request none of the live routers renewed within `lease_s` (cluster/leases.py), so a router
   killed with `kill -9` leaves no request generating into a dead stream and no KV block held.
NOTE: one batched call per worker, not one per request: 256 streams cost a worker 4 small calls per period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from router.pools import WorkerPools

log = logging.getLogger(__name__)
RENEWALS_PER_LEASE = 4  # a router whose loop stalls for 3/4 of a lease still renews in time
RENEW_TIMEOUT_S = 2.0


class LeaseKeeper:
    """Renews this router's requests on every worker (plain class; runs on the router's event loop)."""

    def __init__(self, pools: WorkerPools, lease_s: float) -> None:
        self.pools = pools
        self.lease_s = lease_s
        self.held: set[str] = set()  # request ids in flight on this router
        self.renewals = 0  # rounds sent (each: one call per worker)
        self._task: asyncio.Task[None] | None = None

    def hold(self, request_id: str) -> None:
        """Renew `request_id` from now on (call at admission, on the serving loop)."""
        self.held.add(request_id)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())

    def release(self, request_id: str) -> None:
        """The request ended here: stop renewing it."""
        self.held.discard(request_id)

    async def renew(self) -> None:
        """One round: each worker gets the ids held now (workers that do not answer are skipped)."""
        ids = sorted(self.held)
        await asyncio.gather(*(self._renew_on(w.name, w.actor, ids) for w in list(self.pools.by_name.values())))
        self.renewals += 1

    async def _renew_on(self, name: str, actor: Any, ids: list[str]) -> None:
        try:
            await asyncio.wait_for(actor.renew_leases.remote(ids, self.lease_s), RENEW_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - dead or restarting (the pings tell), or not a worker at all
            log.debug("lease renewal on %s failed: %s", name, e)

    async def _loop(self) -> None:
        while True:
            try:
                await self.renew()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug in one round must not end the renewals
                log.exception("renewing request leases failed")
            await asyncio.sleep(self.lease_s / RENEWALS_PER_LEASE)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
