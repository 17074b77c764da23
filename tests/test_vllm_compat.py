"""Fitting the tools vLLM users run, against one running cluster: their request bodies, request ids, metrics,
traces and health checks.

One 1-prefill + 1-decode cluster (deploy/local.yaml, workers restartable by Ray, tracing to an in-process OTLP
collector) serves the module, with the OpenAI HTTP front and the router's /metrics on its event loop. The health
test kills the workers, so it runs last.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from cluster import tracing
from router.metrics_http import start_metrics_server
from router.openai_api import start_http
from router.v1 import inference_pb2 as pb
from tests.helpers import RouterServer, start_test_cluster
from tests.test_vllm_compat_params import BENCH_CHAT, BENCH_COMPLETION

pytestmark = pytest.mark.slow
DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana-dashboard.json"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector in the test process: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[dict[str, str]] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - the gRPC method's name
        with self.lock:
            for rs in request.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans += [{"name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                                    "parent": s.parent_span_id.hex(), "component": resource["service.instance.id"]}
                                   for s in ss.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, names: set[str], within_s: float = 20.0) -> list[dict[str, str]]:
        """The spans of one trace, once every name in `names` arrived (or what arrived by the deadline)."""
        deadline = time.monotonic() + within_s
        while True:
            with self.lock:
                got = [s for s in self.spans if s["trace"] == trace_id]
            if names <= {s["name"] for s in got} or time.monotonic() > deadline:
                return got
            time.sleep(0.2)


@dataclass
class Front:
    cluster: Any
    server: RouterServer
    http: int
    metrics: int
    collector: Collector
    runners: list[Any] = field(default_factory=list)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http}/v1", api_key="unused", max_retries=0,
                             timeout=120)

    def metric(self, name: str, labels: dict[str, str]) -> float:
        return self.server.router.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def front(ray_session):
    collector = Collector()
    grpc_server = grpc.server(ThreadPoolExecutor(4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, grpc_server)
    otlp_port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()

    def edit(config: Any) -> None:
        config.tracing.otlp_endpoint = f"http://127.0.0.1:{otlp_port}"
        config.prefill.max_restarts = config.decode.max_restarts = 1  # the health test kills them

    c, server = start_test_cluster("deploy/local.yaml", "test-vllm-compat", edit=edit, port=0)
    f = Front(c, server, 0, 0, collector)
    try:
        runner, f.http = server.run(start_http(server.router, host="127.0.0.1", port=0, model_name="smollm2"))
        f.runners.append(runner)
        runner, f.metrics = server.run(start_metrics_server(server.router.metrics, "127.0.0.1", 0))
        f.runners.append(runner)
        yield f
    finally:
        for r in f.runners:
            server.run(r.cleanup())
        server.close()
        c.stop()
        tracing.shutdown()
        grpc_server.stop(0)


def post(port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], bytes]:
    """A raw POST as a non-SDK client sends it: status, headers, body."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def get(port: int, path: str, accept: str = "") -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def events(raw: bytes) -> list[Any]:
    """The server-sent events of a stream; the last one must be [DONE]."""
    data = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e.strip()]
    assert data[-1] == b"[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("path, body, text_of", [
    ("/v1/completions", BENCH_COMPLETION, lambda c: c["text"]),
    ("/v1/chat/completions", BENCH_CHAT, lambda c: c["delta"].get("content", "")),
], ids=["completions", "chat"])
def test_vllm_bench_serve_bodies_stream_with_their_request_ids(front, path, body, text_of):
    rid = f"benchmark-serving-{path.count('chat')}"
    status, headers, raw = post(front.http, path, body, {"x-request-id": rid, "Authorization": "Bearer EMPTY"})
    assert status == 200 and headers["X-Request-Id"] == rid
    chunks = events(raw)
    assert "".join(text_of(c["choices"][0]) for c in chunks if c["choices"])  # text came out
    assert chunks[-1]["usage"]["completion_tokens"] >= 1 and not chunks[-1]["choices"]
    assert all(c["id"].endswith(rid) for c in chunks)


def test_openai_sdk_with_extension_fields_gets_the_plain_answer(front):
    client = front.client()
    messages = [{"role": "user", "content": "Name a colour."}]
    plain = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, temperature=0)
    before = front.metric("pdcluster_openai_ignored_fields_total", {"field": "frobnicate"})
    extended = client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0, user="alice", parallel_tool_calls=True,
        n=1, presence_penalty=0, frequency_penalty=0,
        extra_body={"top_k": -1, "min_p": 0, "repetition_penalty": 1.0, "skip_special_tokens": True,
                    "spaces_between_special_tokens": True, "frobnicate": 1})
    assert extended.choices[0].message.content == plain.choices[0].message.content
    assert front.metric("pdcluster_openai_ignored_fields_total", {"field": "frobnicate"}) == before + 1


def test_a_field_that_would_change_the_answer_is_refused_naming_it(front):
    with pytest.raises(openai.BadRequestError) as e:
        front.client().completions.create(model="smollm2", prompt="Hi", max_tokens=2, extra_body={"min_tokens": 2})
    assert e.value.body["param"] == "min_tokens" and "min_tokens" in e.value.message  # type: ignore[index]


def test_x_request_id_round_trips_into_the_answer_logs_and_exemplars(front):
    status, headers, raw = post(front.http, "/v1/completions", {"prompt": "Hello", "max_tokens": 3},
                                {"X-Request-Id": "my-req-42"})
    body = json.loads(raw)
    assert status == 200 and headers["X-Request-Id"] == "my-req-42" and body["id"] == "cmpl-my-req-42"
    assert body["pdcluster"]["request_id"] == "my-req-42" and body["pdcluster"]["timeline"]["total_ms"] > 0
    status, text = get(front.metrics, "/metrics", "application/openmetrics-text; version=1.0.0")
    assert status == 200 and b'request_id="my-req-42"' in text  # the latency histograms' exemplar
    status, headers, raw = post(front.http, "/v1/completions", {"prompt": "Hello", "min_p": 2},
                                {"X-Request-Id": "my-req-43"})
    assert status == 400 and headers["X-Request-Id"] == "my-req-43"  # errors carry it too
    status, _, raw = post(front.http, "/v1/completions", {"prompt": "Hi"}, {"X-Request-Id": "x" * 300})
    assert status == 400 and json.loads(raw)["error"]["param"] == "X-Request-Id"


def scrape(port: int) -> dict[str, list[Any]]:
    """Every sample of a /metrics page, by sample name (`x_bucket`, `x_total`, ...)."""
    status, text = get(port, "/metrics")
    assert status == 200
    out: dict[str, list[Any]] = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_every_metric_the_grafana_dashboard_queries_is_scraped(front):
    front.client().completions.create(model="smollm2", prompt="Fill the histograms", max_tokens=3)
    router = scrape(front.metrics)
    workers = {s.name: s.metrics_port for s in front.server.router.index.workers()}
    assert set(workers) == {"prefill-0", "decode-0"} and all(workers.values())  # advertised in the heartbeats
    for name, port in workers.items():
        own = scrape(port)  # each worker's own /metrics, as an endpoint picker scrapes it
        for metric in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                       "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            assert [s.labels["model_name"] for s in own[metric]] == ["smollm2"], (name, metric)
        assert own["vllm:generation_tokens_total"][0].value >= 1  # the first token there, the rest here
        assert own["pdcluster_engine_step_seconds_count"][0].value >= 1  # NOTE: read by `pdcluster bench path`
        assert own["pdcluster_engine_step_seconds_sum"][0].value > 0
        if name == "prefill-0":
            assert own["vllm:prompt_tokens_total"][0].value > 0
            assert own["vllm:request_prefill_time_seconds_count"][0].value >= 1
    exprs = [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p["targets"]]
    queried = {m for e in exprs for m in re.findall(r"\b((?:vllm:|pdcluster_)[a-z0-9_:]+)", e)}
    assert len(queried) >= 15
    missing = sorted(m for m in queried if m not in router)
    assert not missing, missing
    for m in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
              "vllm:e2e_request_latency_seconds_bucket", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert any(s.labels.get("model_name") == "smollm2" and s.value > 0 for s in router[m]), m
    phases = {s.labels["phase"] for s in router["pdcluster_request_phase_seconds_count"] if s.value > 0}
    assert phases == {"queue", "prefill", "transfer", "decode"}


def by_id(spans: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    return {s["id"]: s for s in spans}


def ancestors(span: dict[str, str], spans: dict[str, dict[str, str]]) -> list[str]:
    """The names of a span's parents, nearest first, up to the span the trace came in with."""
    out = []
    while span["parent"] in spans:
        span = spans[span["parent"]]
        out.append(span["name"])
    return out


def test_spans_link_router_prefill_transfer_and_decode_into_the_clients_trace(front):
    traceparent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
    status, _, _ = post(front.http, "/v1/completions", {"prompt": "Trace me", "max_tokens": 4},
                        {"traceparent": traceparent})
    assert status == 200
    want = {"pdcluster.request", "queue", "prefill", "kv_transfer", "decode", "decode.worker", "kv_take"}
    spans = front.collector.trace(TRACE_ID, want)
    assert want <= {s["name"] for s in spans}, spans
    index = by_id(spans)
    root = next(s for s in spans if s["name"] == "pdcluster.request")
    assert root["parent"] == CLIENT_SPAN and root["component"] == "router"
    one = {s["name"]: s for s in spans if s["name"] in ("kv_transfer", "decode.worker", "kv_take")}
    assert one["kv_transfer"]["component"] == "prefill-0"  # the prefill worker's sender ...
    assert ancestors(one["kv_transfer"], index) == ["prefill", "pdcluster.request"]  # ... under the router's prefill
    assert one["decode.worker"]["component"] == "decode-0"
    assert ancestors(one["decode.worker"], index) == ["decode", "pdcluster.request"]
    assert ancestors(one["kv_take"], index) == ["decode.worker", "decode", "pdcluster.request"]
    worker_phases = {s["name"] for s in spans if s["component"] == "prefill-0"}
    assert {"queue", "prefill", "kv_transfer"} <= worker_phases

    grpc_trace = "0af7651916cd43dd8448eb211c80319c"
    stub = front.server.stub()
    stub.Generate(pb.GenerateRequest(prompt="Trace me over gRPC", sampling=pb.SamplingParams(max_tokens=2)),
                  metadata=[("traceparent", f"00-{grpc_trace}-b7ad6b7169203331-01")], timeout=120)
    spans = front.collector.trace(grpc_trace, {"pdcluster.request", "kv_transfer", "decode.worker"})
    assert {"pdcluster.request", "kv_transfer", "decode.worker"} <= {s["name"] for s in spans}


def health(front: Front) -> tuple[int, Any]:
    status, _ = get(front.http, "/health")
    channel = grpc.insecure_channel(front.server.address)
    try:
        serving = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    finally:
        channel.close()
    return status, serving.status


def wait_health(front: Front, want: tuple[int, Any], within_s: float) -> tuple[int, Any]:
    deadline = time.monotonic() + within_s
    while (got := health(front)) != want and time.monotonic() < deadline:
        time.sleep(0.25)
    return got


def test_health_goes_503_with_the_workers_dead_and_back_when_ray_restarts_them(front):
    import ray

    ok, down = (200, health_pb2.HealthCheckResponse.SERVING), (503, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert wait_health(front, ok, 10) == ok
    for actor in front.cluster.actors.values():
        ray.kill(actor, no_restart=False)  # NOTE: max_restarts 1: Ray starts each again (the model loads anew)
    assert wait_health(front, down, 30) == down
    assert get(front.http, "/live")[0] == 200  # the router process itself is fine
    assert wait_health(front, ok, 240) == ok
    r = front.client().completions.create(model="smollm2", prompt="Back again", max_tokens=2)
    assert r.usage.completion_tokens >= 1
