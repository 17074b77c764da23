"""The router's settings: one small dataclass (the app builds it from the validated `router:` section)."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.chat_template import ChatOptions
from router.policy import Policy


@dataclass(slots=True)
class RouterSettings:
    """What a Router needs to know; `pdcluster.config.RouterConfig.router_settings()` makes one from YAML."""

    model: str  # reported by GetClusterStatus
    mode: str  # "disaggregated" | "colocated"
    transport: str = "grpc"  # KV transport of the workers (a metrics label)
    routing: str = "prefix_aware"  # "prefix_aware" | "round_robin"
    max_inflight: int = 256  # concurrent requests; more are refused (RESOURCE_EXHAUSTED)
    skip_prefill_max_uncached_tokens: int = 64  # a decode worker caching all but this many prefills itself
    request_timeout_s: float = 600.0  # a request not finished by then fails (DEADLINE_EXCEEDED)
    prefill_timeout_s: float = 120.0  # a prefill not back by then is retried on another prefill worker
    slo_ttft_ms: float = 2000.0  # the time-to-first-token target (reported; admission's default limit is 4×)
    slo_itl_ms: float | None = 100.0  # per-step ITL target: bounds the prompt tokens a decode step takes; None: off
    max_predicted_ttft_ms: float | None = None  # refuse requests predicted later (RESOURCE_EXHAUSTED); None: 4× SLO
    stall_timeout_steps: float = 100.0  # a decode stream with no token for this many of the worker's usual steps ...
    stall_timeout_min_s: float = 15.0  # ... (and at least this long) fails over like a dead worker (router/stall.py)
    client_stall_timeout_s: float = 30.0  # a client that reads nothing this long with a full buffer is cut off
    stream_buffer_chunks: int = 16  # chunks buffered per stream in the router, and deltas unread per worker stream
    stream_interval: int = 1  # a stream's chunks go to its client once they carry this many tokens (router/relay.py)
    lease_s: float = 8.0  # a worker aborts a request no live router renewed for this long (router/leases.py)
    chat: ChatOptions = field(default_factory=ChatOptions)  # chat template and tool-call parser (router/tool_calls.py)

    def admission_ttft_ms(self) -> float:
        """The predicted first token past which a request is refused at admission."""
        return self.max_predicted_ttft_ms if self.max_predicted_ttft_ms is not None else 4 * self.slo_ttft_ms

    def policy(self, block_size: int) -> Policy:
        """The routing policy these settings ask for."""
        # NOTE: with one pool there is no prefill pool to skip
        disaggregated = self.mode == "disaggregated"
        skip = self.skip_prefill_max_uncached_tokens if disaggregated else 0
        return Policy(self.routing, block_size, skip, self.slo_itl_ms if disaggregated else None)
