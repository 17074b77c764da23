"""`Pinger`: the router's one ping loop over its workers' actors.

Every `PING_EVERY_S` each worker's actor is pinged once (all at once) and the round's answers go to every listener:
the router's liveness (router/core.py: a worker is live while its heartbeat is fresh and its actor answered within
`LIVE_PING_S`) and the scaler's lost-worker watch (router/scaling.py: a worker whose actor died for good leaves the
pools and the prefix index; one that stops answering is held). One loop, so a worker gets one ping per interval,
whoever reads the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from router.pools import WorkerHandle, WorkerPools

log = logging.getLogger(__name__)
PING_EVERY_S = 0.5
# NOTE: a ping waits up to PING_TIMEOUT_S, so the scaler can tell a slow machine (one late answer) from a hung
# actor (timeouts in a row); a killed or restarting actor's call fails at once (Ray reports it)
PING_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Ping:
    """One worker's answer in a round."""

    worker: WorkerHandle
    error: str  # '' when the actor answered, else the name of what went wrong ('TimeoutError': no answer in time)
    seconds: float  # how long the answer (or the failure) took


PingListener = Callable[[list[Ping]], Awaitable[None]]


class Pinger:
    """Pings every worker of `pools` each interval on one task and hands each round to its listeners."""

    def __init__(self, pools: WorkerPools) -> None:
        self.pools = pools
        self.listeners: list[PingListener] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run the loop from now on (call on the serving loop; idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())

    def listen(self, listener: PingListener) -> None:
        if listener not in self.listeners:
            self.listeners.append(listener)

    async def round(self) -> list[Ping]:
        """Ping every worker once, tell the listeners, return the answers."""
        workers = list(self.pools.by_name.values())
        pings = list(await asyncio.gather(*(self._ping(w) for w in workers)))
        for listener in list(self.listeners):
            try:
                await listener(pings)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - one listener's bug must not stop the others' liveness
                log.exception("a ping listener failed")
        return pings

    async def _loop(self) -> None:
        while True:
            await self.round()
            await asyncio.sleep(PING_EVERY_S)

    @staticmethod
    async def _ping(worker: WorkerHandle) -> Ping:
        started = time.monotonic()
        try:
            await asyncio.wait_for(worker.actor.ping.remote(), PING_TIMEOUT_S)
            error = ""
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - dead, restarting or too slow: the listeners classify it by name
            error = type(e).__name__
        return Ping(worker, error, time.monotonic() - started)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()


class HeartbeatAges:
    """How old each worker's heartbeat is, by this router's own monotonic clock.

    NOTE: a heartbeat's `updated` is the worker's wall clock; comparing it with the router's would take a node whose
    clock is 10 s off for dead (or a dead one for live). Only whether it changed is used: the router notes, on its
    own clock, when it first saw each (epoch, updated) pair. A heartbeat seen for the first time counts as new: its
    key exists, and Redis expires it `HEARTBEAT_TTL_S` after the last beat, by Redis's own clock.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[tuple[int, float], float]] = {}  # worker → ((epoch, updated), seen at)

    def update(self, beats: dict[str, tuple[int, float]], now: float | None = None) -> dict[str, float]:
        """Each worker's heartbeat age (s) given this round's (epoch, updated) per worker; the rest are forgotten."""
        now = time.monotonic() if now is None else now
        seen = {}
        for name, beat in beats.items():
            last = self._seen.get(name)
            seen[name] = last if last is not None and last[0] == beat else (beat, now)
        self._seen = seen
        return {name: now - at for name, (_, at) in seen.items()}

    def age(self, name: str, now: float | None = None) -> float | None:
        """`name`'s heartbeat age as of the last round (None: not seen)."""
        last = self._seen.get(name)
        return None if last is None else (time.monotonic() if now is None else now) - last[1]
