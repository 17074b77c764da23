"""Router: runs one request across the pools and streams its chunks; the gRPC service is a thin face over it.

Life of a request in the router:
1. admission: at most `max_inflight` requests per router (more → RESOURCE_EXHAUSTED);
2. the prompt's block hashes are looked up in the Redis prefix index (one round trip; if Redis is down the
   router routes on load alone and counts the miss);
3. the policy picks a prefill and a decode worker (or only a decode worker that caches the prompt already);
4. the prefill worker returns the first token once the KV reached the decode worker: it is streamed at once;
5. the decode worker streams the rest; the last chunk carries the finish reason, usage and the timeline;
6. if the client goes away, the workers are told to abort and free the request's blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from cluster.logs import REQUEST_ID
from cluster.messages import Role, WorkerInfo, WorkerLoad
from engine.block_hash import hash_prompt_blocks
from engine.tokenizer import Tokenizer
from router.errors import Overloaded
from router.flow import RequestRun
from router.metrics import RouterMetrics
from router.policy import Policy, WorkerView
from router.v1 import inference_pb2 as pb
from router.validate import Checked

log = logging.getLogger(__name__)
LOAD_REFRESH_S = 0.25


@dataclass
class WorkerHandle:
    """One worker as the router sees it: its Ray actor, what it said at start, and its load."""

    name: str
    role: Role
    actor: Any  # ray.actor.ActorHandle
    info: WorkerInfo
    view: WorkerView


class Router:
    """Routes requests over the worker pools (plain class; `router.service` puts gRPC in front of it)."""

    def __init__(self, workers: list[WorkerHandle], index: Any | None, *, model: str, mode: str,
                 routing: str = "prefix_aware", max_inflight: int = 256,
                 skip_prefill_max_uncached_tokens: int = 64, request_timeout_s: float = 600.0,
                 transport: str = "grpc", metrics: RouterMetrics | None = None,
                 prefill_timeout_s: float = 120.0) -> None:
        if not workers:
            raise ValueError("a router needs workers")
        self.workers = {w.name: w for w in workers}
        self.prefill = [w for w in workers if w.role is Role.PREFILL]
        self.decode = [w for w in workers if w.role.decodes]
        self.info = workers[0].info
        self.index = index  # cluster.prefix_index.PrefixIndex, or None without Redis
        self.model, self.mode = model, mode
        self.max_inflight = max_inflight
        self.request_timeout_s = request_timeout_s
        self.transport = transport
        self.prefill_timeout_s = prefill_timeout_s
        self.tokenizer = Tokenizer.from_json(self.info.tokenizer_json)
        self.metrics = metrics or RouterMetrics()
        self.policy = Policy(routing, self.info.block_size,
                             skip_prefill_max_uncached_tokens if mode == "disaggregated" else 0)
        self.inflight = 0
        self.redis_failures = 0
        self._refresher: asyncio.Task[None] | None = None

    # ---- one request -----------------------------------------------------------------------------------------
    async def stream(self, req: Checked, arrived: float | None = None,
                     budget_s: float | None = None) -> AsyncGenerator[pb.GenerateChunk, None]:
        """The chunks of one request; raises Overloaded, InvalidRequestError, WorkerFailed, TransferError.

        With `budget_s` (the request's deadline, from `arrived`), a request whose predicted first token comes
        later than that is refused at once (Overloaded) instead of timing out after using the workers.
        """
        arrived = arrived or time.monotonic()
        REQUEST_ID.set(req.request_id)
        if self.inflight >= self.max_inflight:
            raise Overloaded(f"the router has {self.inflight} requests in flight (router.max_inflight)",
                             req.request_id)
        self.inflight += 1
        self.metrics.set_inflight(self.inflight)
        self._ensure_refresher()
        last_at, first_at, gaps = arrived, 0.0, []
        try:
            matched = await self._lookup(req.token_ids)
            route = self.policy.route(len(req.token_ids), req.params.max_tokens, matched,
                                      [w.view for w in self.prefill], [w.view for w in self.decode])
            if budget_s is not None:
                left = budget_s - (time.monotonic() - arrived)
                if route.predicted_ttft_ms / 1e3 > left:
                    raise Overloaded(f"the first token is predicted in {route.predicted_ttft_ms / 1e3:.1f} s, past "
                                     f"the request's deadline ({left:.1f} s left): the cluster is too busy",
                                     req.request_id)
            run = RequestRun(self, req, route, arrived).chunks()
            async with contextlib.aclosing(run):  # NOTE: closed at once when we are, so its finally aborts now
                async for chunk in run:
                    now = time.monotonic()
                    if chunk.token_ids:
                        if first_at:  # NOTE: tokens that arrive together share the gap since the last chunk
                            gaps += [(now - last_at) / len(chunk.token_ids)] * len(chunk.token_ids)
                        else:
                            first_at = now
                        last_at = now
                    if chunk.finish_reason:
                        self._observe(chunk, first_at - arrived if first_at else None, gaps, now - arrived)
                    yield chunk
        finally:
            self.inflight -= 1
            self.metrics.set_inflight(self.inflight)

    async def stream_within(self, req: Checked, arrived: float,
                            budget_s: float) -> AsyncGenerator[pb.GenerateChunk, None]:
        """`stream`, raising TimeoutError once `budget_s` passed since `arrived`; closing it aborts the request."""
        chunks = self.stream(req, arrived, budget_s)
        try:
            while True:
                remaining = budget_s - (time.monotonic() - arrived)
                if remaining <= 0:
                    raise TimeoutError
                try:
                    chunk = await asyncio.wait_for(anext(chunks), remaining)
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            await chunks.aclose()

    def _observe(self, last: pb.GenerateChunk, ttft: float | None, gaps: list[float], e2e: float) -> None:
        tl, u = last.timeline, last.usage
        log.info("done: %s%s, %d prompt tokens (%d cached) + %d generated, first token %.0f ms, total %.0f ms, %s",
                 f"{tl.prefill_worker} -> " if tl.prefill_worker else "", tl.decode_worker, u.prompt_tokens,
                 u.cached_prompt_tokens, u.completion_tokens, tl.first_token_ms, tl.total_ms, last.finish_reason)
        self.metrics.observe_latency(ttft, gaps, e2e)
        self.metrics.observe_request(u.prompt_tokens, u.cached_prompt_tokens, u.completion_tokens, self.transport,
                                     tl.kv_bytes_sent, None if tl.prefill_skipped else tl.transfer_ms / 1e3,
                                     tl.prefill_worker, tl.decode_worker, self.workers[tl.decode_worker].role)

    def pick_prefill(self, req: Checked, exclude: set[str]) -> WorkerHandle | None:
        """Another prefill worker for a failed attempt (load-based; None when every one was tried)."""
        views = [w.view for w in self.prefill if w.name not in exclude]
        return self.workers[self.policy.pick_prefill(len(req.token_ids), views).name] if views else None

    def pick_decode(self, req: Checked, exclude: set[str]) -> WorkerHandle | None:
        """Another decode worker after a failure (None when there is no other)."""
        views = [w.view for w in self.decode if w.name not in exclude]
        if not views:
            return None
        return self.workers[self.policy.pick_decode(len(req.token_ids), req.params.max_tokens, {}, views).name]

    async def _lookup(self, token_ids: list[int]) -> dict[str, int]:
        if self.index is None:
            return {}
        hashes = hash_prompt_blocks(token_ids, self.info.block_size, self.info.scope)
        started = time.perf_counter()
        try:
            matched = dict(await asyncio.to_thread(self.index.lookup, hashes))
            self.metrics.observe_redis_lookup(time.perf_counter() - started, True)
            return matched
        except Exception as e:  # noqa: BLE001 - Redis down: route on load alone
            self.metrics.observe_redis_lookup(time.perf_counter() - started, False)
            self.redis_failures += 1
            if self.redis_failures == 1 or self.redis_failures % 100 == 0:
                log.warning("prefix index lookup failed (%d so far), routing on load: %s", self.redis_failures, e)
            return {}

    # ---- shared state ----------------------------------------------------------------------------------------
    def _ensure_refresher(self) -> None:
        if self.index is not None and (self._refresher is None or self._refresher.done()):
            self._refresher = asyncio.create_task(self._refresh_loads())

    async def _refresh_loads(self) -> None:
        """Keep the heartbeat loads (written by every worker, read by every router) a quarter second fresh."""
        while True:
            try:
                live = {s.name: s for s in await asyncio.to_thread(self.index.workers)}  # type: ignore[union-attr]
                for name, w in self.workers.items():
                    status = live.get(name)
                    if status is not None:
                        w.view.load = status.load
                        if status.address and status.address != w.info.kv_address:  # NOTE: a restarted worker
                            w.info = dataclasses.replace(w.info, kv_address=status.address, epoch=status.epoch)
                    self.metrics.set_worker_load(name, w.role, w.view.load, status is not None)
            except Exception as e:  # noqa: BLE001 - keep the last loads while Redis is away
                log.debug("heartbeat refresh failed: %s", e)
            await asyncio.sleep(LOAD_REFRESH_S)

    async def status(self) -> pb.ClusterStatus:
        """Workers, their load and KV blocks, and prefix-hit counts, as Redis has them."""
        out = pb.ClusterStatus(model=self.model, mode=self.mode, router_inflight=self.inflight)
        live: dict[str, Any] = {}
        try:
            if self.index is None:
                raise ConnectionError("no prefix index configured")
            live = {s.name: s for s in await asyncio.to_thread(self.index.workers)}
            hits = await asyncio.to_thread(self.index.hit_counts)
            out.redis_ok = True
            out.requested_prompt_tokens, out.cached_prompt_tokens = hits.requested_tokens, hits.cached_tokens
            out.prefix_hit_rate = hits.hit_rate
            per_worker = hits.per_worker
        except Exception:  # noqa: BLE001 - report what is known without Redis
            per_worker = {}
        now = time.time()
        for name, w in self.workers.items():
            s = live.get(name)
            load = s.load if s else WorkerLoad(num_blocks=w.info.num_blocks)
            req, cached = per_worker.get(name, (0, 0))
            out.workers.append(pb.WorkerStatus(
                name=name, role=str(w.role), epoch=s.epoch if s else w.info.epoch, address=w.info.kv_address,
                alive=s is not None, running=load.running, waiting=load.waiting, num_blocks=load.num_blocks,
                free_blocks=load.free_blocks, cached_blocks=load.cached_blocks, requested_prompt_tokens=req,
                cached_prompt_tokens=cached, heartbeat_age_s=max(0.0, now - s.updated) if s else 0.0,
                rss_bytes=load.rss_bytes))
        return out

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
