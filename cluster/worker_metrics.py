"""One worker's own Prometheus metrics, under vLLM's model-server names, on a port of its own.

An endpoint picker (the Gateway API Inference Extension, llm-d) or an autoscaler scrapes each worker directly, as it
would scrape a vLLM pod; the router's /metrics keeps the cluster view. The worker advertises the port in its heartbeat
(`metrics_port`, cluster/prefix_index.py).

| name                                 | type      | meaning                                              |
|--------------------------------------|-----------|------------------------------------------------------|
| `vllm:num_requests_running`          | gauge     | sequences in this worker's running batch             |
| `vllm:num_requests_waiting`          | gauge     | sequences queued, and KV reservations waiting         |
| `vllm:kv_cache_usage_perc`           | gauge     | used KV blocks / all (1 = full)                      |
| `vllm:prompt_tokens_total`           | counter   | prompt tokens this worker took                       |
| `vllm:prefix_cache_queries_total`    | counter   | prompt tokens looked up in its prefix cache          |
| `vllm:prefix_cache_hits_total`       | counter   | of those, found                                      |
| `vllm:generation_tokens_total`       | counter   | tokens this worker sampled                           |
| `vllm:time_to_first_token_seconds`   | histogram | arrival on this worker → its first token             |
| `vllm:request_queue_time_seconds`    | histogram | arrival → first step that computed it                |
| `vllm:request_prefill_time_seconds`  | histogram | that step → first token                              |
| `vllm:lora_requests_info`            | gauge     | labels: max_lora, the adapters of running / waiting  |
|                                      |           | requests (comma-separated); value: the scrape time   |
| `pdcluster_kv_transfer_seconds`      | histogram | prefill workers: first token → KV confirmed          |
| `pdcluster_engine_step_seconds`      | summary   | the engine's steps: how many, and their seconds      |
| `pdcluster_worker_thread_cpu_seconds`| gauge     | label `thread`: CPU seconds of this worker's live     |
|                                      |           | threads by name (the engine's loop, the KV threads,  |
|                                      |           | Ray's), read at scrape time (Linux)                  |

Every series has the label `model_name` (the served model's name), as vLLM's.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, Summary, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cluster.messages import WorkerLoad
from cluster.process import thread_cpu_s

log = logging.getLogger(__name__)
# NOTE: priors until a worker measured its own steps (SmolLM2-135M, one CPU thread, order of magnitude): the router
# predicts with these before any heartbeat carried a measurement
PRIOR_STEP_BASE_S = 0.02  # fixed cost of an engine step
PRIOR_STEP_TOKEN_S = 0.0005  # cost per token computed in a step (2,000 tokens/s)
# NOTE: a worker reports its fit from this many steps on (until then the router predicts with its priors and the
# prefill speed it measured itself): a new worker's first steps (the scaler's warm-up request, with its first KV
# handshake) are cold, and one such step of 1.9 s for 8 tokens, scaled onto the priors' split, predicted its
# 800-token prompts at 32 s against 5 s on the worker beside it: the router sent it nothing (a suite run)
MIN_REPORTED_STEPS = 4
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0)


class LinearCost:
    """time ≈ base + per_token × tokens, fitted by least squares over the last `window` observations.

    NOTE: steps of one size (a decode batch that does not change, prefill chunks all at the step limit, a new
    worker's warm-up step) cannot tell the base from the slope; then the current split (the priors', or the last
    fit's) is kept and scaled to their mean time. Putting the rest on the slope instead made a new worker's one small
    warm-up step (8 tokens, mostly fixed cost) predict its 800-token prompts 10x slower than they are, so the router
    sent it nothing and it never measured a real step (a starved worker).
    """

    def __init__(self, base_s: float, per_token_s: float, window: int = 64) -> None:
        self.base_s, self.per_token_s = base_s, per_token_s
        self.observed = 0  # observations so far (0: still the priors)
        self._window: deque[tuple[float, float]] = deque(maxlen=window)
        # NOTE: running sums of x, y, x², xy over the window (O(1) per observation: the planner's simulator fits
        # one per simulated worker and step); summed afresh once per window, so rounding cannot drift
        self._sums = [0.0, 0.0, 0.0, 0.0]

    def observe(self, tokens: float, seconds: float) -> None:
        """One step (or transfer) of `tokens` that took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        w, sums = self._window, self._sums
        if len(w) == w.maxlen:
            ox, oy = w[0]
            sums[0] -= ox
            sums[1] -= oy
            sums[2] -= ox * ox
            sums[3] -= ox * oy
        w.append((tokens, seconds))
        self.observed += 1
        if self.observed % (w.maxlen or 1) == 0:
            sums[:] = [sum(x for x, _ in w), sum(y for _, y in w), sum(x * x for x, _ in w), sum(x * y for x, y in w)]
        else:
            sums[0] += tokens
            sums[1] += seconds
            sums[2] += tokens * tokens
            sums[3] += tokens * seconds
        n = len(w)
        mx, my = sums[0] / n, sums[1] / n
        sxx = max(0.0, sums[2] - n * mx * mx)
        sxy = sums[3] - n * mx * my
        if n >= 8 and sxx / n >= (0.25 * mx) ** 2 and sxy > 0:  # sizes spread enough to fit both
            slope = sxy / sxx
            if my - slope * mx >= 0:
                self.base_s, self.per_token_s = my - slope * mx, slope
                return
        scale = my / (self.base_s + self.per_token_s * mx)
        self.base_s, self.per_token_s = self.base_s * scale, self.per_token_s * scale

    def heartbeat(self) -> dict[str, int]:
        """The fit as a heartbeat carries it (`WorkerLoad.step_base_us`, `step_token_ns`): zeros, "not measured",
        until MIN_REPORTED_STEPS steps were seen."""
        if self.observed < MIN_REPORTED_STEPS:
            return {"step_base_us": 0, "step_token_ns": 0}
        return {"step_base_us": round(self.base_s * 1e6), "step_token_ns": max(1, round(self.per_token_s * 1e9))}

    def predict(self, tokens: float, steps: int = 1) -> float:
        """Seconds for `tokens` computed in `steps` steps."""
        return steps * self.base_s + tokens * self.per_token_s


class _ThreadCpuCollector(Collector):
    """Where this worker's CPU goes, thread by thread (`pdcluster bench path` reads it around its requests).

    NOTE: a gauge, not a counter: a thread that ends takes its seconds with it."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily("pdcluster_worker_thread_cpu_seconds", "CPU seconds of this worker's live threads, "
                              "by thread name.", labels=["model_name", "thread"])
        for name, seconds in sorted(thread_cpu_s().items()):
            g.add_metric([self.model_name, name], seconds)
        yield g


class _LoadCollector(Collector):
    """The heartbeat numbers, read at scrape time (no copy of the engine's counters to keep in sync)."""

    def __init__(self, model_name: str, load: Callable[[], WorkerLoad]) -> None:
        self.model_name, self.load = model_name, load

    def collect(self) -> Iterator[Any]:
        x, labels = self.load(), [self.model_name]
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests running on this worker.", x.running),
                ("vllm:num_requests_waiting", "Requests waiting on this worker.", x.waiting + x.reserved),
                ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full).",
                 (x.num_blocks - x.free_blocks) / x.num_blocks if x.num_blocks else 0.0)):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            yield g
        for name, doc, value in (
                ("vllm:prompt_tokens", "Prompt tokens processed.", x.prompt_tokens),
                ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", x.prompt_tokens),
                ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", x.cached_prompt_tokens)):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c


class _LoRACollector(Collector):
    """vLLM's `vllm:lora_requests_info`: `adapters()` gives max_lora and the adapters of running and waiting
    requests, read at scrape time."""

    def __init__(self, adapters: Callable[[], tuple[int, list[str], list[str]]]) -> None:
        self.adapters = adapters

    def collect(self) -> Iterator[Any]:
        max_lora, running, waiting = self.adapters()
        g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                              labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        g.add_metric([str(max_lora), ",".join(running), ",".join(waiting)], time.time())
        yield g


class WorkerMetrics:
    """A worker's registry (heartbeat numbers plus what its request path observes) and its /metrics server."""

    def __init__(self, model_name: str, load: Callable[[], WorkerLoad],
                 adapters: Callable[[], tuple[int, list[str], list[str]]] | None = None) -> None:
        self.registry = r = CollectorRegistry()
        r.register(_LoadCollector(model_name, load))
        r.register(_ThreadCpuCollector(model_name))
        if adapters is not None:  # NOTE: only where the engine has LoRA slots, as vLLM with --enable-lora
            r.register(_LoRACollector(adapters))
        m = ("model_name",)
        self.generation = Counter("vllm:generation_tokens", "Generated tokens.", m, registry=r).labels(model_name)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival on this worker to its first token.", m,
                              buckets=LATENCY_BUCKETS_S, registry=r).labels(model_name)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time requests waited on this worker.", m,
                               buckets=LATENCY_BUCKETS_S, registry=r).labels(model_name)
        self.prefill = Histogram("vllm:request_prefill_time_seconds", "Prefill time on this worker.", m,
                                 buckets=LATENCY_BUCKETS_S, registry=r).labels(model_name)
        self.transfer = Histogram("pdcluster_kv_transfer_seconds", "First token to KV confirmed by the decode side.",
                                  m, buckets=LATENCY_BUCKETS_S, registry=r).labels(model_name)
        # NOTE: a count and a sum (no buckets: two additions on the engine thread per step); their rates give the
        # mean step (`pdcluster bench path` sets it beside the engine alone's, on the same prompts)
        self.step = Summary("pdcluster_engine_step_seconds", "The engine's steps on this worker.", m,
                            registry=r).labels(model_name)
        self._server: Any = None
        self.port = 0

    def first_token(self, queue_s: float, prefill_s: float) -> None:
        """Record a request's queue and prefill time here (its time to first token on this worker is the sum)."""
        self.queue.observe(queue_s)
        self.prefill.observe(prefill_s)
        self.ttft.observe(queue_s + prefill_s)

    def serve(self, host: str, port: int) -> int:
        """Serve GET /metrics on host:port (0: a free port) in a thread; the bound port."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self._server.server_port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
