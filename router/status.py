"""GetClusterStatus's answer: the router's workers, their load and KV blocks, and prefix-hit counts, as Redis has
them (what is known without Redis when it is away)."""

from __future__ import annotations

import asyncio
from typing import Any

from cluster.messages import WorkerLoad
from router.pinger import HeartbeatAges
from router.pools import WorkerPools
from router.results import ClusterStatus, WorkerStatus
from router.settings import RouterSettings


async def cluster_status(settings: RouterSettings, inflight: int, index: Any | None, pools: WorkerPools,
                         beats: HeartbeatAges) -> ClusterStatus:
    """The status of a router's cluster (`index`: the prefix index, or None without Redis)."""
    out = ClusterStatus(model=settings.model, mode=settings.mode, router_inflight=inflight)
    live: dict[str, Any] = {}
    try:
        if index is None:
            raise ConnectionError("no prefix index configured")
        live = {s.name: s for s in await asyncio.to_thread(index.workers)}
        hits = await asyncio.to_thread(index.hit_counts)
        out.redis_ok = True
        out.requested_prompt_tokens, out.cached_prompt_tokens = hits.requested_tokens, hits.cached_tokens
        out.prefix_hit_rate = hits.hit_rate
        per_worker = hits.per_worker
    except Exception:  # noqa: BLE001 - report what is known without Redis
        per_worker = {}
    for name, w in pools.by_name.items():
        s = live.get(name)
        load = s.load if s else WorkerLoad(num_blocks=w.info.num_blocks)
        requested, cached = per_worker.get(name, (0, 0))
        out.workers.append(WorkerStatus(
            name=name, role=str(w.role), epoch=s.epoch if s else w.info.epoch, address=w.info.kv_address,
            alive=s is not None, running=load.running, waiting=load.waiting, num_blocks=load.num_blocks,
            free_blocks=load.free_blocks, cached_blocks=load.cached_blocks, requested_prompt_tokens=requested,
            cached_prompt_tokens=cached, heartbeat_age_s=(beats.age(name) or 0.0) if s else 0.0,
            rss_bytes=load.rss_bytes))
    return out
