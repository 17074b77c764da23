"""The Prometheus metrics of a router process (router/metrics_http.py serves them at GET /metrics).

| name                                      | type      | labels       | meaning                                  |
|-------------------------------------------|-----------|--------------|------------------------------------------|
| `pdcluster_requests_total`                | counter   | api, status  | finished requests by API and gRPC status |
| `pdcluster_time_to_first_token_seconds`   | histogram |              | arrival → first generated token          |
| `pdcluster_inter_token_latency_seconds`   | histogram |              | gap between tokens (one per gap)         |
| `pdcluster_e2e_request_latency_seconds`   | histogram |              | arrival → last token                     |
| `pdcluster_prompt_tokens_total`           | counter   |              | prompt tokens of finished requests       |
| `pdcluster_prefix_cache_hit_tokens_total` | counter   |              | prompt tokens found in the prefix cache  |
| `pdcluster_generation_tokens_total`       | counter   |              | generated (completion) tokens            |
| `pdcluster_kv_transfer_bytes_total`       | counter   | transport    | KV bytes moved prefill → decode          |
| `pdcluster_kv_transfer_seconds`           | histogram | transport    | one request's KV transfer                |
| `pdcluster_worker_requests_total`         | counter   | worker, role | requests a worker took part in           |
| `pdcluster_redis_lookup_seconds`          | histogram |              | a successful prefix-index lookup         |
| `pdcluster_redis_lookup_failures_total`   | counter   |              | prefix-index lookups that failed         |
| `pdcluster_failovers_total`               | counter   | kind         | requests moved to another worker         |
| `pdcluster_retries_total`                 | counter   | kind         | retried steps of a request               |
| `pdcluster_router_inflight_requests`      | gauge     |              | requests the router holds now            |
| `pdcluster_stream_buffered_chunks`        | gauge     |              | chunks waiting for their clients to read |
| `pdcluster_client_stalls_total`           | counter   |              | streams cut off: their client read nothing |
| `pdcluster_worker_queue_depth`            | gauge     | worker, role | waiting requests (heartbeat)             |
| `pdcluster_worker_running_requests`       | gauge     | worker, role | running requests (heartbeat)             |
| `pdcluster_kv_blocks_used`                | gauge     | worker, role | num_blocks - free_blocks (heartbeat)     |
| `pdcluster_kv_blocks_free`                | gauge     | worker, role | free KV blocks, cached ones included     |
| `pdcluster_kv_blocks_cached`              | gauge     | worker, role | blocks in the prefix cache, used or free |
| `pdcluster_worker_up`                     | gauge     | worker, role | 1 while the heartbeat is fresh, else 0   |
| `pdcluster_request_phase_seconds`         | histogram | phase        | queue, prefill, transfer, decode (timeline) |
| `pdcluster_openai_ignored_fields_total`   | counter   | field        | unknown request fields accepted and ignored |
| `pdcluster_prefill_placement_total`       | counter   | where        | prefill_pool, prefix, slo, no_prefill  |
| `pdcluster_admission_rejected_total`      | counter   | reason       | refused: inflight, backlog, deadline   |
| `pdcluster_worker_failures_total`         | counter   | worker       | requests failed there (breaker opened) |
| `pdcluster_ttft_prediction_error_seconds` | histogram | placement    | actual - predicted TTFT (late > 0)     |
| `pdcluster_ttft_prediction_ratio`         | gauge     | placement    | actual / predicted TTFT (moving mean)  |

Next to these, the names of vLLM's model server (`vllm:*`, label `model_name`), so dashboards, autoscalers and
endpoint pickers built for vLLM read the cluster: `vllm:num_requests_running` / `_waiting` and
`vllm:kv_cache_usage_perc` (0..1) summed over the workers' heartbeats, the latency histograms
(`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`, `vllm:e2e_request_latency_seconds`,
`vllm:request_queue_time_seconds`, `vllm:request_prefill_time_seconds`, `vllm:request_decode_time_seconds`), and the
counters `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:prefix_cache_queries_total`,
`vllm:prefix_cache_hits_total` (tokens) and `vllm:request_success_total` (label `finished_reason`). Each worker serves
its own view of the same names (cluster/worker_metrics.py). Latency observations carry the request id as an exemplar
(shown in the OpenMetrics format, `Accept: application/openmetrics-text`).

NOTE: prometheus_client also exports `<name>_created` for each counter and histogram series (the Unix time the
series was first touched; its text format shows it as a gauge family). That is the library's standard behaviour;
turning it off (`disable_created_metrics`) is process-wide, so it is left on.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

from cluster.messages import WorkerLoad
from cluster.worker_metrics import LATENCY_BUCKETS_S
from router import histograms

_WORKER = ("worker", "role")
_MODEL = ("model_name",)
PHASES = ("queue", "prefill", "transfer", "decode")


class RouterMetrics:
    """The router's Prometheus metrics (one registry per router)."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        # NOTE: a registry per instance (not the global REGISTRY) so several routers can live in one process.
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self._loads: dict[str, WorkerLoad] = {}  # live workers' last heartbeat loads, for the cluster view
        self._totals = [0, 0, 0, 0]  # over _loads: running, waiting (+ reserved), used blocks, blocks
        r = self.registry
        self.requests = Counter("pdcluster_requests_total", "Finished requests by API and gRPC status.",
                                ("api", "status"), registry=r)
        self.ttft = Histogram("pdcluster_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("pdcluster_inter_token_latency_seconds", "Gap between consecutive generated tokens.",
                             buckets=histograms.ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("pdcluster_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("pdcluster_prompt_tokens_total", "Prompt tokens of finished requests.",
                                     registry=r)
        self.cache_hit_tokens = Counter("pdcluster_prefix_cache_hit_tokens_total",
                                        "Prompt tokens served from the prefix cache.", registry=r)
        self.generation_tokens = Counter("pdcluster_generation_tokens_total", "Generated tokens.", registry=r)
        self.kv_bytes = Counter("pdcluster_kv_transfer_bytes_total", "KV cache bytes moved from prefill to decode.",
                                ("transport",), registry=r)
        self.kv_seconds = Histogram("pdcluster_kv_transfer_seconds", "Duration of one request's KV transfer.",
                                    ("transport",), buckets=histograms.KV_TRANSFER_BUCKETS_S, registry=r)
        self.worker_requests = Counter("pdcluster_worker_requests_total", "Requests each worker took part in.",
                                       _WORKER, registry=r)
        self.redis_seconds = Histogram("pdcluster_redis_lookup_seconds", "Duration of a successful prefix lookup.",
                                       buckets=histograms.REDIS_BUCKETS_S, registry=r)
        self.redis_failures = Counter("pdcluster_redis_lookup_failures_total", "Prefix-index lookups that failed.",
                                      registry=r)
        self.failovers = Counter("pdcluster_failovers_total", "Requests moved to another worker.", ("kind",),
                                 registry=r)
        self.retries = Counter("pdcluster_retries_total", "Retried steps of a request.", ("kind",), registry=r)
        self.inflight = Gauge("pdcluster_router_inflight_requests", "Requests the router holds now.", registry=r)
        self.client_stalls = Counter("pdcluster_client_stalls_total", "Streams cut off because their client read "
                                     "nothing for router.client_stall_timeout_s.", registry=r)
        self.stream_buffered = Gauge("pdcluster_stream_buffered_chunks", "Chunks buffered for clients that have "
                                     "not read them yet, all streams (router/relay.py).", registry=r)
        # NOTE: read at scrape time: a Gauge.inc per chunk (a lock each) was a few % of the router's CPU per token
        self.buffered_chunks = 0
        self.stream_buffered.set_function(lambda: self.buffered_chunks)
        self.queue_depth = Gauge("pdcluster_worker_queue_depth", "Waiting requests of a worker (heartbeat).",
                                 _WORKER, registry=r)
        self.running = Gauge("pdcluster_worker_running_requests", "Running requests of a worker (heartbeat).",
                             _WORKER, registry=r)
        self.blocks_used = Gauge("pdcluster_kv_blocks_used", "KV blocks in use on a worker.", _WORKER, registry=r)
        self.blocks_free = Gauge("pdcluster_kv_blocks_free", "Free KV blocks on a worker.", _WORKER, registry=r)
        self.blocks_cached = Gauge("pdcluster_kv_blocks_cached", "KV blocks in the prefix cache (used or free).",
                                   _WORKER, registry=r)
        self.worker_up = Gauge("pdcluster_worker_up", "1 while the worker's heartbeat is fresh, else 0.", _WORKER,
                               registry=r)
        self.phase = Histogram("pdcluster_request_phase_seconds", "Where requests spent their time (timeline).",
                               ("phase",), buckets=LATENCY_BUCKETS_S, registry=r)
        self.ignored = Counter("pdcluster_openai_ignored_fields_total", "Unknown request fields accepted and ignored.",
                               ("field",), registry=r)
        self.placement = Counter("pdcluster_prefill_placement_total", "Where prompts were computed.", ("where",),
                                 registry=r)
        self.admission_rejected = Counter("pdcluster_admission_rejected_total", "Requests refused at admission.",
                                          ("reason",), registry=r)
        self.worker_failures = Counter("pdcluster_worker_failures_total", "Requests that failed on a worker.",
                                       ("worker",), registry=r)
        # NOTE: signed: a prediction that was too early (the request came late) is positive
        self.ttft_error = Histogram("pdcluster_ttft_prediction_error_seconds", "Actual minus predicted time to first "
                                    "token, by where the prompt was computed.", ("placement",),
                                    buckets=histograms.TTFT_ERROR_BUCKETS_S, registry=r)
        self.ttft_ratio = Gauge("pdcluster_ttft_prediction_ratio", "Actual over predicted time to first token "
                                "(exponential moving mean), by where the prompt was computed.", ("placement",),
                                registry=r)
        self._ratios: dict[str, float] = {}
        self._vllm(r)

    def _vllm(self, r: CollectorRegistry) -> None:
        """vLLM's model-server names, labelled with the served model's name."""
        def hist(name: str, doc: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S) -> Histogram:
            return Histogram(name, doc, _MODEL, buckets=buckets, registry=r)

        self.v_running = Gauge("vllm:num_requests_running", "Requests running on the workers.", _MODEL, registry=r)
        self.v_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting on the workers.", _MODEL, registry=r)
        self.v_kv = Gauge("vllm:kv_cache_usage_perc", "KV cache usage of the workers (1 = full).", _MODEL, registry=r)
        self.v_ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.")
        self.v_itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency.", histograms.ITL_BUCKETS_S)
        self.v_e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        self.v_queue = hist("vllm:request_queue_time_seconds", "Time requests spent waiting.")
        self.v_prefill = hist("vllm:request_prefill_time_seconds", "Time requests spent in prefill.")
        self.v_decode = hist("vllm:request_decode_time_seconds", "Time requests spent in decode.")
        self.v_prompt = Counter("vllm:prompt_tokens", "Prompt tokens processed.", _MODEL, registry=r)
        self.v_generation = Counter("vllm:generation_tokens", "Generated tokens.", _MODEL, registry=r)
        self.v_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", _MODEL,
                                 registry=r)
        self.v_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", _MODEL, registry=r)
        self.v_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                 ("model_name", "finished_reason"), registry=r)
        # NOTE: one model per router: each series is bound once (it exists from the start, at 0), so the per-token
        # observations below do no label lookup
        m = self.model_name
        self.v_running, self.v_waiting, self.v_kv = (g.labels(m) for g in (self.v_running, self.v_waiting, self.v_kv))
        self.v_ttft, self.v_itl, self.v_e2e = (h.labels(m) for h in (self.v_ttft, self.v_itl, self.v_e2e))
        self.v_queue, self.v_prefill, self.v_decode = (
            h.labels(m) for h in (self.v_queue, self.v_prefill, self.v_decode))
        self.v_prompt, self.v_generation, self.v_queries, self.v_hits = (
            c.labels(m) for c in (self.v_prompt, self.v_generation, self.v_queries, self.v_hits))

    def request_done(self, api: str, status: str) -> None:
        """Count one finished request by its API ("grpc" | "http") and gRPC status name ("OK", ...)."""
        self.requests.labels(api=api, status=status).inc()

    def observe_latency(self, ttft_s: float | None, itl_s: Sequence[float], e2e_s: float,
                        request_id: str = "") -> None:
        """Record one request's latencies; `ttft_s` is None when no token came out."""
        ex = histograms.exemplar(request_id)
        if ttft_s is not None:
            self.ttft.observe(ttft_s, ex)
            self.v_ttft.observe(ttft_s, ex)
        histograms.observe_all(self.itl, itl_s)  # NOTE: one increment per bucket, not two locked ones per token
        histograms.observe_all(self.v_itl, itl_s)
        self.e2e.observe(e2e_s, ex)
        self.v_e2e.observe(e2e_s, ex)

    def observe_phases(self, queue_s: float, prefill_s: float, transfer_s: float | None, decode_s: float,
                       request_id: str = "") -> None:
        """Record where one finished request spent its time (`transfer_s` None when no KV moved)."""
        ex = histograms.exemplar(request_id)
        for phase, seconds in zip(PHASES, (queue_s, prefill_s, transfer_s, decode_s), strict=True):
            if seconds is not None:
                self.phase.labels(phase=phase).observe(seconds, ex)
        self.v_queue.observe(queue_s, ex)
        self.v_prefill.observe(prefill_s, ex)
        self.v_decode.observe(decode_s, ex)

    def finished(self, reason: str) -> None:
        """Count one request that finished with `reason` ("stop" | "length")."""
        self.v_success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def ignored_field(self, name: str) -> None:
        """Count one unknown request field that was accepted and ignored."""
        self.ignored.labels(field=name).inc()

    def observe_request(self, prompt_tokens: int, cached_prompt_tokens: int, completion_tokens: int,
                        transport: str, kv_bytes: int, kv_seconds: float | None, prefill_worker: str,
                        decode_worker: str, decode_role: str = "decode") -> None:
        """Record one finished request's tokens, KV transfer and workers (`prefill_worker` "" when none ran)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.cache_hit_tokens.inc(cached_prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.v_prompt.inc(prompt_tokens)
        self.v_generation.inc(completion_tokens)
        self.v_queries.inc(prompt_tokens)
        self.v_hits.inc(cached_prompt_tokens)
        self.kv_bytes.labels(transport=transport).inc(kv_bytes)
        if kv_seconds is not None:
            self.kv_seconds.labels(transport=transport).observe(kv_seconds)
        if prefill_worker:
            self.worker_requests.labels(worker=prefill_worker, role="prefill").inc()
        self.worker_requests.labels(worker=decode_worker, role=decode_role).inc()

    def observe_redis_lookup(self, seconds: float, ok: bool) -> None:
        """Record one prefix-index lookup: its duration when it succeeded, else a failure."""
        if ok:
            self.redis_seconds.observe(seconds)
        else:
            self.redis_failures.inc()

    def failover(self, kind: str) -> None:
        """Count one request moved to another worker of `kind` ("prefill" | "decode")."""
        self.failovers.labels(kind=kind).inc()

    def retry(self, kind: str) -> None:
        """Count one retried step of `kind`."""
        self.retries.labels(kind=kind).inc()

    def placed(self, where: str) -> None:
        """Count a prompt computed `where` ("prefill_pool", or on the decode worker: "prefix", "slo", "no_prefill")."""
        self.placement.labels(where=where).inc()

    def observe_prediction(self, placement: str, predicted_s: float, actual_s: float) -> None:
        """How far a request's first token was from the router's prediction when it placed it."""
        self.ttft_error.labels(placement=placement).observe(actual_s - predicted_s)
        if predicted_s > 0:
            ratio = actual_s / predicted_s
            mean = self._ratios.get(placement)
            self._ratios[placement] = mean = ratio if mean is None else 0.9 * mean + 0.1 * ratio
            self.ttft_ratio.labels(placement=placement).set(mean)

    def rejected(self, reason: str) -> None:
        """Count a request refused at admission ("inflight", "backlog", "deadline")."""
        self.admission_rejected.labels(reason=reason).inc()

    def worker_failed(self, worker: str) -> None:
        """Count a request that failed on `worker`."""
        self.worker_failures.labels(worker=worker).inc()

    def buffered(self, change: int) -> None:
        """Chunks buffered for clients changed by `change` (router/relay.py's on_size)."""
        self.buffered_chunks += change

    def set_inflight(self, n: int) -> None:
        """Set the number of requests the router holds now."""
        self.inflight.set(n)

    def set_worker_load(self, worker: str, role: str, load: WorkerLoad | None, alive: bool) -> None:
        """Set a worker's gauges from its heartbeat load; without one (no heartbeat) they stay as they were."""
        labels = {"worker": worker, "role": str(role)}
        if load is not None:
            self.queue_depth.labels(**labels).set(load.waiting)
            self.running.labels(**labels).set(load.running)
            self.blocks_used.labels(**labels).set(load.num_blocks - load.free_blocks)
            self.blocks_free.labels(**labels).set(load.free_blocks)
            self.blocks_cached.labels(**labels).set(load.cached_blocks)
        self.worker_up.labels(**labels).set(1 if alive else 0)
        # NOTE: cluster totals by difference (the router refreshes every worker 4 times a second)
        self._add_to_totals(self._loads.pop(worker, None), -1)
        if alive and load is not None:
            self._loads[worker] = load
            self._add_to_totals(load, 1)
        running, waiting, used, total = self._totals
        self.v_running.set(running)
        self.v_waiting.set(waiting)
        self.v_kv.set(used / total if total else 0.0)

    def _add_to_totals(self, load: WorkerLoad | None, sign: int) -> None:
        if load is not None:
            parts = (load.running, load.waiting + load.reserved, load.num_blocks - load.free_blocks, load.num_blocks)
            self._totals = [t + sign * x for t, x in zip(self._totals, parts, strict=True)]

    def render(self, openmetrics_format: bool = False) -> bytes:
        """The registry in the Prometheus text format (or OpenMetrics, which shows the exemplars)."""
        if openmetrics_format:
            return bytes(openmetrics.generate_latest(self.registry))
        return generate_latest(self.registry)

