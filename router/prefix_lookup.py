"""A request's cached prefix on each worker, from the Redis prefix index (cluster/prefix_index.py).

One round trip per request, on a thread (the Redis client blocks). When Redis fails (down, slow, the breaker open)
the request is routed on load alone: the lookup answers no match, counts the failure
(`pdcluster_redis_lookup_failures_total`) and logs the first failure and every hundredth after it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from cluster.messages import WorkerInfo
from engine.block_hash import hash_prompt_blocks
from router.metrics import RouterMetrics

# NOTE: the logger these lines had in router/core.py (log settings name it)
log = logging.getLogger("router.core")


class PrefixLookups:
    """One router's lookups: the failures so far, for its log."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.failures = 0

    async def matched(self, index: Any | None, info: WorkerInfo, token_ids: list[int],
                      lora_key: str) -> dict[str, int]:
        """How many leading blocks of the prompt each worker holds (`index`: a PrefixIndex, or None: no Redis)."""
        if index is None:
            return {}
        # NOTE: under the request's adapter key, as its workers hash: another adapter's cached blocks never match
        hashes = hash_prompt_blocks(token_ids, info.block_size, info.scope, extra_keys=lora_key)
        started = time.perf_counter()
        try:
            matched = dict(await asyncio.to_thread(index.lookup, hashes))
            self.metrics.observe_redis_lookup(time.perf_counter() - started, True)
            return matched
        except Exception as e:  # noqa: BLE001 - Redis down: route on load alone
            self.metrics.observe_redis_lookup(time.perf_counter() - started, False)
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning("prefix index lookup failed (%d so far), routing on load: %s", self.failures, e)
            return {}
