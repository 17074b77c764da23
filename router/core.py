"""Router: runs one request across the pools and streams its chunks; the gRPC service is a thin face over it.

Life of a request in the router:
1. admission: at most `max_inflight` requests per router (more → RESOURCE_EXHAUSTED), counted from before the
   fronts read and tokenize a request (`admit`) to its end;
2. the prompt's block hashes are looked up in the Redis prefix index (one round trip; if Redis is down the
   router routes on load alone and counts the miss);
3. the policy picks a prefill and a decode worker among those up (or only a decode worker: one that caches the
   prompt already, or one whose next step is sooner than the prefill pool's queue: router/policy.py); a request
   whose first token is predicted past `admission_ttft_ms()` (the prefill backlog) or its deadline is refused
   (RESOURCE_EXHAUSTED; DEADLINE_EXCEEDED when even an idle cluster could not meet the deadline);
4. a `RequestRun` (router/flow.py) runs it: the prefill worker returns the first token once the KV reached the
   decode worker, streamed at once; the decode worker streams the rest; the last chunk carries the finish reason,
   usage and the timeline;
5. if the client goes away, the workers are told to abort and free the request's blocks.

Chunks and statuses are plain dataclasses (router/results.py); only the gRPC service turns them into protobuf.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import Any

from cluster import tracing
from cluster.logs import REQUEST_ID
from cluster.prefix_index import HEARTBEAT_TTL_S
from router.admission import Admission, check_route, check_slots
from router.errors import ClientStalled, Overloaded
from router.flow import RequestRun
from router.leases import LeaseKeeper
from router.lora import Adapters
from router.metrics import RouterMetrics
from router.pinger import HeartbeatAges, Ping, Pinger
from router.policy import WorkerView
from router.pools import WorkerHandle, WorkerPools
from router.prefix_lookup import PrefixLookups
from router.relay import relayed
from router.results import Chunk, ClusterStatus
from router.served import Served
from router.settings import RouterSettings
from router.stall import StallClock
from router.status import cluster_status
from router.timeouts import until
from router.traffic import TrafficWindow
from router.validate import Checked

log = logging.getLogger(__name__)
LOAD_REFRESH_S = 0.25
# NOTE: a worker is live while its last heartbeat (every 0.5 s) is younger than the heartbeat key's TTL. Not less:
# a worker beats between engine steps, and one long step on a loaded machine must not make it look dead.
HEALTH_STALE_S = HEARTBEAT_TTL_S
# NOTE: ... and it must answer a ping (router/pinger.py, every 0.5 s): a killed actor's heartbeat stays fresh for up
# to the TTL, and Ray may restart it within that time; while it is dead or restarting, a call to it fails at once or
# waits, so a ping not answered within LIVE_PING_S marks it down at once (an actor's event loop answers in
# milliseconds while it is up).
LIVE_PING_S = 1.0


class Router:
    """Routes requests over the worker pools (plain class; `router.service` puts gRPC in front of it)."""

    def __init__(self, workers: Sequence[WorkerHandle], index: Any | None, settings: RouterSettings,
                 metrics: RouterMetrics | None = None) -> None:
        self.settings = settings
        self.pools = WorkerPools(workers, settings.policy(workers[0].info.block_size))
        self.info = self.pools.info
        # NOTE: every worker loads the same adapters, but a fresh process lacks the run-time ones for a while
        self.adapters = Adapters(self.info.loras, self.pools.missing)  # router/lora.py
        self.pools.on_new_process.append(self.adapters.restore)
        self.index = index  # cluster.prefix_index.PrefixIndex, or None without Redis
        self.metrics = metrics or RouterMetrics(model_name=settings.model)
        self.pools.metrics = self.metrics
        self.inflight = 0
        self.pending = 0  # admitted, still being read or tokenized (Admission): counts against max_inflight too
        self.lookups = PrefixLookups(self.metrics)  # the prompt's cached blocks per worker (router/prefix_lookup.py)
        self.stall = StallClock(settings.stall_timeout_steps, settings.stall_timeout_min_s)  # per-worker step times
        self._refresher: asyncio.Task[None] | None = None
        self._live: set[str] | None = None  # workers with a fresh heartbeat; None: not known yet (or no Redis)
        self._answering: set[str] | None = None  # workers whose actor answered the last ping; None: none yet
        self.pinger = Pinger(self.pools)  # the one ping loop: this router's liveness and the scaler's watch read it
        self.pinger.listen(self._on_pings)
        self.beats = HeartbeatAges()  # heartbeat ages by this router's clock, not the workers' (clock skew)
        self.health_listeners: list[Callable[[bool], None]] = []  # called when `healthy()` changes
        self.fatal_checks: list[Callable[[], str | None]] = []  # each: why this process cannot recover, or None
        self._dead: set[str] = set()  # workers whose actor Ray reported dead for good (no restart left)
        self.traffic = TrafficWindow(settings.slo_ttft_ms, settings.slo_itl_ms)  # what an autoscaler reads
        self.leases = LeaseKeeper(self.pools, settings.lease_s)  # NOTE: workers abort what no live router renews
        self.served = Served(self.pools, self.metrics, self.traffic, settings)  # what a finished request records

    @property
    def prefill(self) -> list[WorkerHandle]:
        """The prefill pool's workers."""
        return self.pools.prefill

    @property
    def decode(self) -> list[WorkerHandle]:
        """The decode (or colocated) pool's workers."""
        return self.pools.decode

    @property
    def max_inflight(self) -> int:
        """The admission limit (`settings.max_inflight`); may be changed while serving."""
        return self.settings.max_inflight

    @max_inflight.setter
    def max_inflight(self, value: int) -> None:
        self.settings.max_inflight = value

    # ---- one request -----------------------------------------------------------------------------------------
    def admit(self, request_id: str = "") -> Admission:
        """A slot for a request about to be read or tokenized (release it, or pass it to `stream`); Overloaded when
        `max_inflight` requests are in flight or being admitted."""
        check_slots(self.inflight + self.pending, self.max_inflight, request_id or None, self.metrics)
        self.pending += 1
        return Admission(self)

    async def stream(self, req: Checked, arrived: float | None = None, budget_s: float | None = None,
                     traceparent: str = "", admission: Admission | None = None) -> AsyncGenerator[Chunk, None]:
        """The chunks of one request; raises Overloaded, InvalidRequestError, WorkerFailed, TransferError.

        With `budget_s` (the request's deadline, from `arrived`), a request whose predicted first token comes
        later than that is refused at once (Overloaded) instead of timing out after using the workers.
        `traceparent`: the client's W3C trace context; the request's spans join its trace.
        """
        arrived = arrived or time.monotonic()
        REQUEST_ID.set(req.request_id)
        self.traffic.arrived(len(req.token_ids), req.params.max_tokens)
        ended = False
        if admission is not None and admission.held:
            admission.release()  # NOTE: its slot becomes this request's, with no await in between
        else:
            try:
                check_slots(self.inflight + self.pending, self.max_inflight, req.request_id, self.metrics)
            except Overloaded:
                self.traffic.failed()
                raise
        self.inflight += 1
        self.metrics.set_inflight(self.inflight)
        self.leases.hold(req.request_id)
        self._ensure_refresher()
        last_at, first_at, gaps = arrived, 0.0, []
        held: WorkerView | None = None
        span = tracing.start("pdcluster.request", traceparent, **{"pdcluster.request_id": req.request_id,
                                                                   "pdcluster.prompt_tokens": len(req.token_ids)})
        parent = tracing.traceparent_of(span)
        try:
            queued = tracing.start("queue", parent)
            try:
                matched = await self.lookups.matched(self.index, self.info, req.token_ids,
                                                     self.adapters.key(req.params.lora))
                route = self.pools.route(len(req.token_ids), req.params.max_tokens, matched, req.params.lora)
            finally:
                tracing.end(queued)
            self.metrics.placed(route.why or "prefill_pool")
            left_s = None if budget_s is None else budget_s - (time.monotonic() - arrived)
            check_route(self.pools, route, len(req.token_ids), matched, left_s, self.settings.admission_ttft_ms(),
                        req.request_id, self.metrics)
            # NOTE: the prompt tokens a decode worker computes count in its queue until the first token, so requests
            # routed before its next heartbeat see them (the prefill pool's are counted by the run)
            held = self.pools[route.decode].view if route.decode_prefill_tokens else None
            if held is not None:
                held.pending_tokens += route.decode_prefill_tokens
            run = RequestRun(req, route, arrived, self.pools, metrics=self.metrics,
                             prefill_timeout_s=self.settings.prefill_timeout_s, traceparent=parent,
                             deadline=arrived + (budget_s or self.settings.request_timeout_s),
                             stall=self.stall, stream_window=self.settings.stream_buffer_chunks,
                             stream_interval=self.settings.stream_interval).chunks()
            async with contextlib.aclosing(run):  # NOTE: closed at once when we are, so its finally aborts now
                async for chunk in run:
                    now = time.monotonic()
                    if chunk.token_ids:
                        if first_at:  # NOTE: tokens that arrive together share the gap since the last chunk
                            gaps += [(now - last_at) / len(chunk.token_ids)] * len(chunk.token_ids)
                        else:
                            first_at = now
                            if held is not None:
                                held.pending_tokens -= route.decode_prefill_tokens
                                held = None
                        last_at = now
                    if chunk.finish_reason:
                        ended = True
                        self.served.record(chunk, route, first_at - arrived if first_at else None, gaps,
                                           now - arrived, req.request_id)
                    yield chunk
        finally:
            if not ended:
                self.traffic.failed()
            if held is not None:
                held.pending_tokens -= route.decode_prefill_tokens
            tracing.end(span)
            self.leases.release(req.request_id)
            self.inflight -= 1
            self.metrics.set_inflight(self.inflight)

    async def stream_within(self, req: Checked, arrived: float, budget_s: float, traceparent: str = "",
                            admission: Admission | None = None,
                            on_cut: Callable[[ClientStalled], Awaitable[None]] | None = None
                            ) -> AsyncGenerator[Chunk, None]:
        """`stream`, raising TimeoutError once `budget_s` passed since `arrived`; closing it aborts the request.

        NOTE: through a bounded buffer (router/relay.py): a client that reads slowly pauses the decode worker's
        stream, and one that reads nothing for `client_stall_timeout_s` has its request aborted (ClientStalled).
        """
        # NOTE: the request's deadline is `arrived + budget_s` on the event loop's clock too: asyncio's is
        # time.monotonic() (the router runs under asyncio.run, pdcluster/serve.py)
        chunks = relayed(until(self.stream(req, arrived, budget_s, traceparent, admission), arrived + budget_s),
                         self.settings.stream_buffer_chunks,
                         self.settings.client_stall_timeout_s, req.request_id, self.metrics.buffered,
                         self.metrics.client_stalls.inc, on_cut, Chunk.joined, self.settings.stream_interval)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    # ---- shared state ----------------------------------------------------------------------------------------
    def _ensure_refresher(self) -> None:
        if self.index is not None and (self._refresher is None or self._refresher.done()):
            self._refresher = asyncio.create_task(self._refresh_loads())
        if self.index is not None:
            self.pinger.start()

    async def _refresh_loads(self) -> None:
        """Keep the heartbeat loads (written by every worker, read by every router) a quarter second fresh."""
        while True:
            try:
                live = {s.name: s for s in await asyncio.to_thread(self.index.workers)}  # type: ignore[union-attr]
                self.pools.refresh(live, self.metrics)
                ages, answering = self.beats.update({n: (s.epoch, s.updated) for n, s in live.items()}), self._answering
                self._set_live({n for n, age in ages.items()
                                if age < HEALTH_STALE_S and (answering is None or n in answering)})
            except Exception as e:  # noqa: BLE001 - keep the last loads while Redis is away
                log.debug("heartbeat refresh failed: %s", e)
                if self._answering is not None:  # NOTE: no heartbeats to read: a worker is live while it answers
                    self._set_live(set(self._answering))
            await asyncio.sleep(LOAD_REFRESH_S)

    async def _on_pings(self, pings: list[Ping]) -> None:
        """The workers whose actor answered this round within LIVE_PING_S."""
        self._answering = {p.worker.name for p in pings if not p.error and p.seconds <= LIVE_PING_S}
        self._dead = {p.worker.name for p in pings if p.error == "ActorDiedError"}

    # ---- health ----------------------------------------------------------------------------------------------
    def start_health(self) -> None:
        """Follow the workers' heartbeats from now on, not only while requests run (call on the serving loop)."""
        self._ensure_refresher()

    def healthy(self) -> bool:
        """Whether a live worker can prefill and a live one can decode (unknown or without Redis: True)."""
        if self._live is None:
            return True
        # NOTE: every role can prefill (a decode worker prefills when no prefill worker is left: router/flow.py,
        # stage 1), so a live worker that decodes is enough
        return any(w.role.decodes for name, w in self.pools.by_name.items() if name in self._live)

    def unrecoverable(self) -> str | None:
        """Why this router cannot serve again without a restart of its process (the liveness probe); None if it can.

        NOTE: a worker that Ray is restarting, or Redis down, is not a reason (they come back by themselves); every
        decode-capable worker dead for good (no restart left), or an embedded Redis that cannot be restarted, is.
        """
        decoders = [n for n, w in self.pools.by_name.items() if w.role.decodes]
        if decoders and all(n in self._dead for n in decoders):
            return f"every decode-capable worker is dead for good ({', '.join(sorted(decoders))})"
        return next((reason for check in self.fatal_checks if (reason := check())), None)

    def _set_live(self, live: set[str]) -> None:
        was = self.healthy()
        self._live = live
        self.pools.set_live(live)
        if self.healthy() != was:
            log.warning("cluster health: %s (live workers: %s)", "SERVING" if self.healthy() else "NOT_SERVING",
                        ", ".join(sorted(live)) or "none")
            for listener in self.health_listeners:
                listener(self.healthy())

    async def status(self) -> ClusterStatus:
        """Workers, their load and KV blocks, and prefix-hit counts, as Redis has them (router/status.py)."""
        return await cluster_status(self.settings, self.inflight, self.index, self.pools, self.beats)

    async def close(self) -> None:
        """Stop the load refresher, the pinger, the lease renewals and the workers' delta channels."""
        self.pinger.close()
        await self.leases.close()
        for worker in self.pools.by_name.values():
            worker.channel.close()
        if self._refresher is not None:
            self._refresher.cancel()
