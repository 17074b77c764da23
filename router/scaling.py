"""Pools that change while serving: workers join, drain and leave, or are lost with their node.

Life of a scale request (`PoolScaler.scale`, one at a time):
1. `check`: the targets are checked (a pool the mode runs keeps at least one worker, at most `MAX_POOL_SIZE`);
   a bad one is INVALID_ARGUMENT naming the field;
2. `add`: each missing worker is started by the launcher (a Ray actor on a node with its pool's resources), answers
   `info` (it registered with the prefix index), runs one warm-up request, and only then joins the pools;
3. `drain`: each surplus worker (the least busy, the newest first) is held from new requests; its running ones
   finish, or past `drain_timeout_s` move to another worker through the run's failover (router/flow.py). Then it is
   closed (it unregisters its prefix-index entries; its KV blocks go with its process) and its actor killed.
Alongside, the watch reads the router's one ping loop (router/pinger.py, every worker twice a second): a worker whose
actor is gone for good (its node was lost, and Ray will not restart it) leaves the pools and its index entries are
purged at once; one that stops answering is held from new requests until it answers again. Neither ever empties the
decode pool (requests would have no route).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from cluster.messages import DecodeRequest, PrefillRequest, Role
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from router.pinger import Ping
from router.pools import WorkerHandle

if TYPE_CHECKING:
    from router.core import Router

log = logging.getLogger(__name__)
MISSED_PINGS_TO_HOLD = 2  # timeouts in a row before a worker is held (one slow ping on a loaded machine is not enough)
DRAIN_POLL_S = 0.25
IDLE_CHECKS = 3  # a draining worker must look idle this many polls in a row (heartbeats lag by up to 0.5 s)
MAX_POOL_SIZE = 1024
LIVE_WITHIN_S = 10.0  # a new worker's first heartbeat and ping reach the router within a few seconds
WARMUP_TOKENS = list(range(1000, 1008))  # shorter than a block: the warm-up leaves no prefix-index entry
# NOTE: by name, as router/errors.py: the router does not import ray. ActorDiedError: dead for good (no restart
# left); ActorUnavailableError: the connection broke (the node may be gone, or Ray is restarting the actor).
DEAD_ERRORS = ("ActorDiedError",)
UNAVAILABLE_ERRORS = ("ActorUnavailableError", "RayActorError")


class WorkerLauncher(Protocol):
    """What starts and stops worker actors (pdcluster.launch.Cluster); both block, the scaler runs them in threads."""

    def start_worker(self, role: Role) -> WorkerHandle:
        """A new worker of `role`'s pool, started and answering `info`."""
        ...

    def stop_worker(self, name: str) -> None:
        """Close the worker (it unregisters from the prefix index) and kill its actor."""
        ...


@dataclass
class ScaleResult:
    """The pools after a scale request, and what changed."""

    prefill: int
    decode: int
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


class PoolScaler:
    """Adds, drains and removes workers of a serving Router; follows which workers are lost."""

    def __init__(self, router: Router, launcher: WorkerLauncher | None, drain_timeout_s: float = 60.0) -> None:
        self.router = router
        self.pools = router.pools
        self.launcher = launcher
        self.drain_timeout_s = drain_timeout_s
        self.mode = router.settings.mode
        self.draining: set[str] = set()
        self.held: set[str] = set()  # held by `watch` because their actor does not answer
        self.lost: list[str] = []  # removed because their actor died (newest last)
        self._missed: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self.listeners: list[Callable[[ScaleResult], None]] = []  # told after each scale (the autoscaler)

    # ---- the pools' sizes ------------------------------------------------------------------------------------
    def counts(self) -> tuple[int, int]:
        """Workers serving in the prefill and the decode (or colocated) pool, draining ones not counted."""
        alive = [w for n, w in self.pools.by_name.items() if n not in self.draining]
        return sum(w.role is Role.PREFILL for w in alive), sum(w.role.decodes for w in alive)

    def check(self, prefill: int | None, decode: int | None) -> None:
        """INVALID_ARGUMENT naming the field for a target the mode cannot run."""
        if self.launcher is None:
            raise InvalidRequestError("prefill", "this router joined a cluster another process started; scale "
                                                 "through that one (`pdcluster serve`)")
        for name, value in (("prefill", prefill), ("decode", decode)):
            if value is not None and not 0 <= value <= MAX_POOL_SIZE:
                raise InvalidRequestError(name, f"must be between 0 and {MAX_POOL_SIZE}, got {value}")
        if decode is not None and decode < 1:
            raise InvalidRequestError("decode", "the decode pool needs at least one worker")
        if self.mode == "colocated" and prefill:
            raise InvalidRequestError("prefill", "a colocated cluster has no prefill pool: size its one pool with "
                                                 "`decode`")
        if self.mode == "disaggregated" and prefill is not None and prefill < 1:
            raise InvalidRequestError("prefill", "the prefill pool needs at least one worker in mode "
                                                 "'disaggregated'")

    async def scale(self, prefill: int | None = None, decode: int | None = None) -> ScaleResult:
        """Bring the pools to `prefill` and `decode` workers (None: leave that pool as it is)."""
        self.check(prefill, decode)
        async with self._lock:
            result = ScaleResult(*self.counts())
            decode_role = Role.COLOCATED if self.mode == "colocated" else Role.DECODE
            plan = [(Role.PREFILL, prefill, result.prefill), (decode_role, decode, result.decode)]
            # NOTE: grow before shrinking, so a prefill:decode swap never leaves a pool short meanwhile; one at a
            # time, so each start sees the room its predecessors took (a worker Ray cannot place is refused with
            # RESOURCE_EXHAUSTED by the launcher instead of waiting forever; those started before it stay)
            added = [await self.add(role) for role, target, now in plan if target is not None
                     for _ in range(max(0, target - now))]
            victims = [name for role, target, now in plan if target is not None
                       for name in self._victims(role, now - target)]
            await asyncio.gather(*(self.drain(name) for name in victims))
            result.prefill, result.decode = self.counts()
            result.added, result.removed = [w.name for w in added], victims
            log.info("pools scaled: %d prefill, %d decode (removed: %s)", result.prefill, result.decode,
                     ", ".join(victims) or "none")
            for listener in self.listeners:
                listener(result)
            return result

    def _victims(self, role: Role, n: int) -> list[str]:
        """The `n` workers of `role` to drain: the least busy first, then the newest (highest index)."""
        if n <= 0:
            return []
        workers = [w for w in self.pools.by_name.values() if w.role is role and w.name not in self.draining]
        workers.sort(key=lambda w: (w.view.busy(), -int(w.name.rsplit("-", 1)[-1])))
        return [w.name for w in workers[:n]]

    # ---- 2. add ----------------------------------------------------------------------------------------------
    async def add(self, role: Role) -> WorkerHandle:
        """Start one worker of `role`, warm it up, and let it take requests."""
        assert self.launcher is not None
        started = time.monotonic()
        handle = await asyncio.to_thread(self.launcher.start_worker, role)
        try:
            await self._warm_up(handle)
        except BaseException:
            await asyncio.to_thread(self.launcher.stop_worker, handle.name)
            raise
        self.pools.add(handle)
        # NOTE: the router picks only live workers (a heartbeat in the index and an answered ping): return once the
        # new one is, so a client that scaled up finds it taking requests
        deadline = time.monotonic() + LIVE_WITHIN_S
        while not self.pools.is_up(handle.name) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        log.info("%s joined the %s pool (ready in %.1f s)", handle.name, role, time.monotonic() - started)
        return handle

    async def _warm_up(self, handle: WorkerHandle) -> None:
        """One 1-token request through the new worker: its first forward pass (and a prefill worker's first KV
        handshake with a decode worker) happens before a client's request does."""
        rid = f"warmup-{handle.name}-{uuid.uuid4().hex[:8]}"
        params = SamplingParams(max_tokens=1, temperature=0.0)
        if handle.role.decodes:
            stream = handle.actor.generate.options(num_returns="streaming").remote(
                DecodeRequest(rid, params, list(WARMUP_TOKENS)))
            async for ref in stream:
                await ref
            return
        target = next((w for w in self.pools.decode), None)
        if target is not None:
            # NOTE: the request ends at its first token, so the decode worker frees the reservation at once
            await handle.actor.prefill.remote(PrefillRequest(rid, list(WARMUP_TOKENS), params, target.info.kv_address))

    # ---- 3. drain --------------------------------------------------------------------------------------------
    async def drain(self, name: str) -> None:
        """Hold `name` from new requests, wait for its running ones (or move them), then stop it."""
        assert self.launcher is not None
        self.draining.add(name)
        worker = self.pools[name]
        self.pools.hold(name)
        started = time.monotonic()
        idle = 0
        while idle < IDLE_CHECKS and time.monotonic() - started < self.drain_timeout_s:
            await asyncio.sleep(DRAIN_POLL_S)
            load = worker.view.load
            busy = worker.view.inflight or (load is not None and (load.running or load.waiting or load.reserved
                                                                  or load.pending_prefill_tokens))
            # NOTE: the heartbeat loads lag by up to a beat (0.5 s): only a heartbeat after the hold counts
            idle = idle + 1 if not busy and time.monotonic() - started > 1.0 else 0
        if idle < IDLE_CHECKS:
            log.warning("%s still busy after %.0f s of draining: its requests move to other workers", name,
                        self.drain_timeout_s)
        self.pools.remove(name)
        await asyncio.to_thread(self.launcher.stop_worker, name)
        self.draining.discard(name)
        log.info("%s drained and removed (%.1f s)", name, time.monotonic() - started)

    # ---- lost workers ----------------------------------------------------------------------------------------
    def start_watch(self) -> None:
        """Follow the workers from now on (call on the serving loop): a listener of the router's ping loop."""
        self.router.pinger.listen(self.on_pings)
        self.router.pinger.start()

    async def on_pings(self, pings: list[Ping]) -> None:
        """One round of the router's pings: hold, release or remove each worker by its answer."""
        for p in pings:
            if self._judge(p.worker, p.error):
                await self._remove_lost(p.worker)

    def _judge(self, worker: WorkerHandle, error: str) -> bool:
        """Hold or release the worker by its last ping; True when it is lost for good."""
        name = worker.name
        if name not in self.pools.by_name or name in self.draining:
            return False
        if not error:
            self._missed.pop(name, None)
            if name in self.held:
                self.held.discard(name)
                self.pools.hold(name, False)
                log.warning("%s answers again: taking requests", name)
            return False
        if error in DEAD_ERRORS and self._can_lose(worker):
            return True
        self._missed[name] = self._missed.get(name, 0) + 1
        # NOTE: a broken connection is a clear sign (its node is gone or Ray is restarting it); a timeout may be
        # a slow machine, so only a second one in a row holds the worker
        if name not in self.held and (error in UNAVAILABLE_ERRORS or self._missed[name] >= MISSED_PINGS_TO_HOLD) \
                and self._can_lose(worker):
            self.held.add(name)
            self.pools.hold(name)
            log.warning("%s does not answer (%s): no new requests go to it", name, error)
        return False

    def _can_lose(self, worker: WorkerHandle) -> bool:
        """Whether the pools keep a worker of each role they need without this one."""
        return not worker.role.decodes or any(w is not worker for w in self.pools.decode)

    async def _remove_lost(self, worker: WorkerHandle) -> None:
        name = worker.name
        self.held.discard(name)
        self._missed.pop(name, None)
        self.pools.remove(name)
        self.lost.append(name)
        purged = 0
        if self.router.index is not None:
            try:
                purged = await asyncio.to_thread(self.router.index.purge_worker, name)
            except Exception as e:  # noqa: BLE001 - Redis away: the entries expire with the heartbeat's TTL check
                log.warning("could not purge %s from the prefix index: %s", name, e)
        log.warning("%s is lost (its actor died): removed from the pools, %d prefix-index blocks purged", name,
                    purged)

    async def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.router.pinger.listeners.remove(self.on_pings)
