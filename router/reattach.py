"""`Reattacher`: an extra router finds its workers again after the process that owns them replaced them.

Life of a re-attach (only in a router that joined workers another process started, `pdcluster router`):
1. a worker whose actor stops answering the router's pings (router/pinger.py), or that the scaler's watch removed
   as lost, is looked up again by its name in the cluster's Ray namespace, at most every `every_s`;
2. a different actor under that name (a restarted `serve` started a new one) is asked for its `info` and heartbeat
   key; the router's handle then points at it (or it rejoins the pools), and the prefix index checks heartbeats
   with the new key (a `serve` without `security.cluster_token_env` makes a new cluster token per start);
3. with no actor under the name yet, nothing changes: the next round tries again.
NOTE: this needs a Ray that outlives the `serve` (address 'auto' or host:port); a private Ray goes with its
process, and an extra router attached to it then answers 503 (its /live too, once Ray reports the workers dead).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from cluster.messages import WorkerInfo
from router.pinger import Ping
from router.policy import WorkerView
from router.pools import WorkerHandle, WorkerPools

log = logging.getLogger(__name__)
# name, the actor the router holds -> (a different live actor under that name, its info, its heartbeat key), or None
Resolver = Callable[[str, Any], "tuple[Any, WorkerInfo, bytes | None] | None"]


class Reattacher:
    """Points an extra router's handles at the actors now running under its workers' names."""

    def __init__(self, pools: WorkerPools, resolve: Resolver, index: Any | None = None, every_s: float = 2.0) -> None:
        self.pools = pools
        self.resolve = resolve
        self.index = index  # cluster.prefix_index.PrefixIndex: its signing key follows the workers'
        self.every_s = every_s
        self.reattached: list[str] = []  # worker names re-attached so far (newest last)
        self._tried: dict[str, float] = {}

    async def on_pings(self, pings: list[Ping]) -> None:
        """A listener of the router's ping loop: look the silent and the removed workers up again."""
        now = time.monotonic()
        candidates = [p.worker for p in pings if p.error] + list(self.pools.removed.values())
        for worker in candidates:
            if now - self._tried.get(worker.name, 0.0) < self.every_s:
                continue
            self._tried[worker.name] = now
            try:
                found = await asyncio.to_thread(self.resolve, worker.name, worker.actor)
            except Exception as e:  # noqa: BLE001 - Ray busy or the new actor still loading: next round
                log.debug("looking up %s again failed: %s", worker.name, e)
                continue
            if found is not None:
                self._swap(worker, *found)

    def _swap(self, worker: WorkerHandle, actor: Any, info: WorkerInfo, key: bytes | None) -> None:
        if self.index is not None and key is not None:
            self.index.signing_key = key
        if worker.name in self.pools.by_name:
            worker.actor, worker.info = actor, info
            self.pools.breakers[worker.name].succeeded()
        else:
            self.pools.add(WorkerHandle(worker.name, info.role, actor, info,
                                        WorkerView(worker.name, info.num_blocks, info.max_num_seqs)))
        self.reattached.append(worker.name)
        log.warning("%s: re-attached to the worker now running under that name (epoch %d)", worker.name, info.epoch)
