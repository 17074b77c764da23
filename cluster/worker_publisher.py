"""A worker's side of the prefix index: its registration (an epoch), the publisher thread and request leases.

`IndexMember` is the base of `Worker` (cluster/worker.py). The publisher thread, every PUBLISH_INTERVAL_S:
1. checks the worker's TP group (cluster/tp_group.py) and, every LEASE_CHECK_S, aborts the requests whose lease no
   live router renewed (cluster/leases.py);
2. registers the worker if it is not yet (Redis was down at start: retried with backoff, then the whole cache is
   resynced);
3. sends the prefix cache's stored/evicted block events, the prefix-hit counts and, at least every
   HEARTBEAT_INTERVAL_S and at once when requests joined or left the batch, a heartbeat with the load (a round
   with none of these, checked without the engine's lock, takes no lock: `_publish_due`);
4. on a Redis outage logs once, keeps the hit counts and resyncs under a new epoch when Redis is back; a newer
   incarnation of the worker (same name, higher epoch) makes this one stop writing (`Superseded`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from cluster import tp_group
from cluster.leases import RequestLeases
from cluster.messages import WorkerLoad
from cluster.worker_metrics import WorkerMetrics
from cluster.worker_spec import WorkerSpec
from engine.block_hash import BlockHash
from engine.llm_engine import LLMEngine
from engine.loop import EngineLoop

if TYPE_CHECKING:
    from cluster.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.05
HEARTBEAT_INTERVAL_S = 0.5
REGISTER_BACKOFF_S = (0.2, 5.0)  # first and largest wait between registration attempts while Redis is down
LEASE_CHECK_S = 0.5  # how often running requests' leases are checked (cluster/leases.py)


class Superseded(RuntimeError):
    """A newer incarnation of this worker (same name, higher epoch) registered: this one is a zombie."""


class IndexMember:
    """The prefix-index registration, publisher thread and leases of a Worker (its base class)."""

    # NOTE: what this base uses of the worker; Worker.__init__ sets each before `_join_index`
    name: str
    spec: WorkerSpec
    engine: LLMEngine
    loop: EngineLoop
    metrics: WorkerMetrics
    leases: RequestLeases
    _closed: threading.Event
    _hits: list[int]  # prompt tokens requested, served from cache: not yet counted in Redis (under the loop lock)
    load: Callable[[], WorkerLoad]
    abort: Callable[[str, str], None]

    @property
    def kv_address(self) -> str:
        return ""

    def _join_index(self) -> None:
        """Connect to the prefix index (when the spec names Redis), try to register once, start the publisher."""
        spec = self.spec
        self.index: PrefixIndex | None = None
        self.epoch = 0
        if spec.redis_url:
            from cluster.prefix_index import PrefixIndex, heartbeat_key
            from cluster.redis_breaker import RedisBreaker
            from cluster.redis_client import connect

            # NOTE: heartbeats signed with the cluster token: a reader trusts no KV address a stranger wrote
            self.index = PrefixIndex(connect(spec.redis_url, spec.redis_auth), spec.key_prefix,
                                     RedisBreaker(spec.name), heartbeat_key(spec.transfer.cluster_token))
            self.metrics.registry.register(self.index.breaker)
        self._registered = False
        self._register_wait = REGISTER_BACKOFF_S[0]
        self._register_at = 0.0  # monotonic time of the next registration attempt
        # NOTE: one attempt here, so a worker that starts with Redis up answers `info` with its epoch; with Redis
        # down the constructor must not raise (Ray would mark the actor dead for good): the publisher retries
        self._try_register()
        self._resync = False
        self._superseded = False  # a newer incarnation of this worker registered: this one writes no more
        self._publisher = threading.Thread(target=self._publish_loop, daemon=True, name=f"{spec.name}-publisher")
        self._publisher.start()

    def _leave_index(self) -> None:
        """Unregister (at close, after the publisher stopped); Redis may already be gone."""
        if self.index is not None and self._registered:
            try:
                self.index.unregister_worker(self.name, self.epoch)
            except Exception as e:  # noqa: BLE001 - Redis may already be gone at shutdown
                log.info("%s: could not unregister from the prefix index: %s", self.name, e)

    def _try_register(self) -> bool:
        """Register with the prefix index (a new epoch) once; on failure schedule the next try with backoff."""
        if self.index is None or self._registered:
            return True
        now = time.monotonic()
        if now < self._register_at:
            return False
        try:
            self.epoch = self.index.register_worker(self.name)
        except Exception as e:  # noqa: BLE001 - Redis down or refusing: serve anyway, register later
            if self._register_wait == REGISTER_BACKOFF_S[0]:
                log.warning("%s: cannot register with the prefix index (%s); serving without it, retrying", self.name,
                            e)
            self._register_at = now + self._register_wait
            self._register_wait = min(REGISTER_BACKOFF_S[1], self._register_wait * 2)
            return False
        if self._register_wait != REGISTER_BACKOFF_S[0]:
            log.warning("%s: registered with the prefix index (epoch %d)", self.name, self.epoch)
        self._registered = True
        return True

    def renew_leases(self, request_ids: list[str], lease_s: float) -> None:
        """A live router still wants these requests (cluster/leases.py)."""
        self.leases.renew(request_ids, lease_s)

    def _expire_leases(self) -> None:
        """Abort every running request whose lease no live router renewed (its blocks are freed)."""
        with self.loop.between_steps:
            scheduler = self.engine.scheduler
            running = [seq.request_id for seq in (*scheduler.running, *scheduler.waiting, *scheduler.paused)]
        for rid in self.leases.expired(running):
            log.warning("%s: no live router renewed the lease of %s for %.0f s: aborting it", self.name, rid,
                        self.leases.lease_s or 0.0)
            self.abort(rid, "its router is gone (lease expired)")

    def _publish_loop(self) -> None:
        last_beat, failing, leases_at, beaten = 0.0, False, 0.0, (0, 0, 0)
        while not self._closed.wait(PUBLISH_INTERVAL_S):
            tp_group.check(self.name, self.engine.runner, self._closed)
            if time.monotonic() - leases_at >= LEASE_CHECK_S:
                leases_at = time.monotonic()
                try:
                    self._expire_leases()
                except Exception:  # noqa: BLE001 - a bug here must not stop the heartbeats
                    log.exception("%s: checking request leases failed", self.name)
            if self.index is None or self._superseded:
                continue
            if not self._registered:
                if not self._try_register():
                    continue
                self._resync = True  # NOTE: the whole cache goes to the index (events drained meanwhile are lost)
            if not self._publish_due(last_beat, beaten):
                continue
            with self.loop.between_steps:
                stored, removed = self.engine.block_manager.pool.drain_events()
                if self._resync:
                    stored, removed = self.engine.block_manager.pool.cached_hashes(), []
                hits, self._hits = self._hits, [0, 0]
                members = self._members()
            now = time.monotonic()
            beat = _beat_due(now, last_beat, members, beaten)
            try:
                self._publish(stored, removed, hits, beat=beat)
            except Superseded as e:
                log.error("%s: %s; this process stops writing to the prefix index", self.name, e)
                self._superseded = True
                continue
            except Exception as e:  # noqa: BLE001 - Redis down: keep serving, resync when it is back
                if not failing:
                    log.warning("%s: prefix index unreachable (%s); will resync", self.name, e)
                failing, self._resync = True, True
                with self.loop.between_steps:
                    self._hits[0] += hits[0]
                    self._hits[1] += hits[1]
                continue
            if failing:
                log.warning("%s: prefix index reachable again; resynced", self.name)
            failing = self._resync = False
            if beat:
                last_beat, beaten = now, members

    def _publish_due(self, last_beat: float, beaten: tuple[int, int, int]) -> bool:
        """Whether this round has anything for Redis, read without the engine's lock (lengths and a flag the engine
        thread sets; the round takes the lock only then).

        NOTE: the lock is handed over between two steps, the engine waiting meanwhile: taken 20 times a second for
        nothing, on an idle worker and through most rounds of a slow model's decode."""
        if self._resync or self._hits[0] or self.engine.block_manager.pool.has_events():
            return True
        return _beat_due(time.monotonic(), last_beat, self._members(), beaten)

    def _members(self) -> tuple[int, int, int]:
        """The batch's membership a heartbeat reports: waiting, running and reserved requests."""
        s = self.engine.stats()
        return s.num_waiting, s.num_running, s.num_reserved

    def _publish(self, stored: Seq[BlockHash], removed: Seq[BlockHash], hits: list[int], *, beat: bool) -> None:
        assert self.index is not None
        if self._resync:
            # NOTE: events drained while Redis was away are lost; a new epoch drops every entry of the old one
            # (evicted blocks included), and `stored` is then the whole cache
            self._renew_epoch()
        if stored or removed:
            if not self.index.publish(self.name, self.epoch, stored, removed):
                # NOTE: our epoch is no longer current (Redis was emptied): take a new one and republish all
                self._renew_epoch()
                raise RuntimeError("epoch was stale; registered again")
        if hits[0]:
            self.index.count_hits(self.name, hits[0], hits[1])
        if beat and not self.index.heartbeat(self.name, self.epoch, self.spec.role, self.kv_address, self.load(),
                                             metrics_port=self.metrics.port):
            self._renew_epoch()
            raise RuntimeError("heartbeat epoch was stale; registered again")

    def _renew_epoch(self) -> None:
        """A new epoch, unless a newer incarnation of this worker registered since ours (Superseded)."""
        assert self.index is not None
        epoch = self.index.renew_epoch(self.name, self.epoch)
        if epoch is None:
            raise Superseded(f"a newer incarnation of {self.name} registered after our epoch {self.epoch}")
        self.epoch = epoch


def _beat_due(now: float, last_beat: float, members: tuple[int, int, int], beaten: tuple[int, int, int]) -> bool:
    """A heartbeat at least every HEARTBEAT_INTERVAL_S, and at once (within PUBLISH_INTERVAL_S) when requests joined
    or left the batch: routers (and anyone reading the index) see a new load without waiting."""
    return now - last_beat >= HEARTBEAT_INTERVAL_S or members != beaten
