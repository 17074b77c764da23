"""What a served request leaves in the router's books at its last chunk: the placement and its predicted first token
in the timeline, the prediction's error, its workers' breakers closed, the "done" log line, the latency, phase and
request metrics, and the traffic window an autoscaler reads."""

from __future__ import annotations

import logging

from router.metrics import RouterMetrics
from router.policy import Route
from router.pools import WorkerPools
from router.results import Chunk
from router.settings import RouterSettings
from router.traffic import TrafficWindow

# NOTE: the "done" line keeps the logger it had in router/core.py (log settings name it)
log = logging.getLogger("router.core")


class Served:
    """Records each request that ended with a last chunk (finish reason, usage, timeline) for one router."""

    def __init__(self, pools: WorkerPools, metrics: RouterMetrics, traffic: TrafficWindow,
                 settings: RouterSettings) -> None:
        self.pools, self.metrics, self.traffic, self.settings = pools, metrics, traffic, settings

    def record(self, last: Chunk, route: Route, ttft: float | None, gaps: list[float], e2e: float,
               request_id: str) -> None:
        """`last` (its timeline gets the placement) with the request's first token, gaps and total (seconds)."""
        self._predicted(last, route)
        self._observe(last, ttft, gaps, e2e, request_id)

    def _predicted(self, last: Chunk, route: Route) -> None:
        """The placement and its predicted first token in the timeline; the prediction's error in the metrics."""
        if last.timeline is None:
            return
        placement = route.why or "prefill_pool"
        tl = last.timeline
        tl.placement, tl.predicted_ttft_ms = placement, route.predicted_ttft_ms
        if tl.first_token_ms:
            self.metrics.observe_prediction(placement, route.predicted_ttft_ms / 1e3, tl.first_token_ms / 1e3)

    def _observe(self, last: Chunk, ttft: float | None, gaps: list[float], e2e: float, request_id: str) -> None:
        assert last.timeline is not None and last.usage is not None  # NOTE: every last chunk carries both
        timeline, usage = last.timeline, last.usage
        for name in (timeline.prefill_worker, timeline.decode_worker):  # NOTE: both served it: breakers close
            if name:
                self.pools.mark_ok(name)
        log.info("done: %s%s, %d prompt tokens (%d cached) + %d generated, first token %.0f ms, total %.0f ms, %s",
                 f"{timeline.prefill_worker} -> " if timeline.prefill_worker else "", timeline.decode_worker,
                 usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens, timeline.first_token_ms,
                 timeline.total_ms, last.finish_reason)
        self.metrics.observe_latency(ttft, gaps, e2e, request_id)
        self.traffic.finished(ttft, sum(gaps) / len(gaps) if gaps else None)
        self.metrics.finished(last.finish_reason)
        self.metrics.observe_phases(timeline.queue_ms / 1e3, timeline.prefill_ms / 1e3,
                                    None if timeline.prefill_skipped else timeline.transfer_ms / 1e3,
                                    timeline.decode_ms / 1e3, request_id)
        self.metrics.observe_request(
            usage.prompt_tokens, usage.cached_prompt_tokens, usage.completion_tokens, self.settings.transport,
            timeline.kv_bytes_sent, None if timeline.prefill_skipped else timeline.transfer_ms / 1e3,
            timeline.prefill_worker, timeline.decode_worker, self.pools[timeline.decode_worker].role)
