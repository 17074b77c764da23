"""The router's Prometheus metrics: values after known calls, isolation, names, and the /metrics HTTP server."""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from cluster.messages import WorkerLoad
from router.metrics import RouterMetrics
from router.metrics_http import start_metrics_server

Labels = tuple[tuple[str, str], ...]

# The known workload: 20 requests, each (status, prompt, cached, completion, prefill worker, decode worker).
STATUSES = ["OK"] * 17 + ["INVALID_ARGUMENT"] * 2 + ["RESOURCE_EXHAUSTED"]
PROMPT, CACHED, COMPLETION = 100, 32, 16  # per OK request
KV_BYTES, KV_S = 4096, 0.002  # per OK request over "grpc"
TTFT_S, ITL_S, E2E_S = 0.05, (0.01, 0.02, 0.03), 0.5


def samples(metrics: RouterMetrics) -> dict[tuple[str, Labels], float]:
    """Every sample of render() by (sample name, sorted labels)."""
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def lbl(**kw: str) -> Labels:
    return tuple(sorted(kw.items()))


def feed(m: RouterMetrics) -> None:
    """The known sequence of calls."""
    for i, status in enumerate(STATUSES):
        m.request_done("grpc" if i % 4 else "http", status)
        if status != "OK":
            continue
        m.observe_latency(TTFT_S, ITL_S, E2E_S)
        # NOTE: every 5th OK request ran prefill on the decode worker (no prefill worker, no transfer).
        disagg = i % 5 != 0
        m.observe_request(PROMPT, CACHED, COMPLETION, "grpc", KV_BYTES if disagg else 0,
                          KV_S if disagg else None, "p0" if disagg else "", "d0" if i % 2 else "d1")
    m.observe_latency(None, [], 1.5)  # a request that failed before its first token
    for s, ok in [(0.001, True), (0.002, True), (0.5, False)]:
        m.observe_redis_lookup(s, ok)
    for kind in ["prefill", "prefill", "decode"]:
        m.failover(kind)
    m.retry("decode")
    m.set_inflight(7)
    m.set_worker_load("p0", "prefill", WorkerLoad(waiting=3, running=2, num_blocks=100, free_blocks=60,
                                                  cached_blocks=25), alive=True)
    m.set_worker_load("d0", "decode", WorkerLoad(running=5), alive=False)


OK_IDX = [i for i, s in enumerate(STATUSES) if s == "OK"]
N_OK = len(OK_IDX)
N_DISAGG = sum(1 for i in OK_IDX if i % 5 != 0)
N_API = {api: sum(1 for i in OK_IDX if ("grpc" if i % 4 else "http") == api) for api in ("grpc", "http")}


@pytest.fixture(scope="module")
def fed() -> dict[tuple[str, Labels], float]:
    m = RouterMetrics()
    feed(m)
    return samples(m)


@pytest.mark.parametrize("name, labels, want", [
    ("pdcluster_requests_total", lbl(api="grpc", status="OK"), N_API["grpc"]),
    ("pdcluster_requests_total", lbl(api="http", status="OK"), N_API["http"]),
    ("pdcluster_requests_total", lbl(api="grpc", status="INVALID_ARGUMENT"), 2),  # indices 17, 18
    ("pdcluster_requests_total", lbl(api="grpc", status="RESOURCE_EXHAUSTED"), 1),  # index 19
    ("pdcluster_prompt_tokens_total", (), N_OK * PROMPT),
    ("pdcluster_prefix_cache_hit_tokens_total", (), N_OK * CACHED),
    ("pdcluster_generation_tokens_total", (), N_OK * COMPLETION),
    ("pdcluster_kv_transfer_bytes_total", lbl(transport="grpc"), N_DISAGG * KV_BYTES),
    ("pdcluster_worker_requests_total", lbl(worker="p0", role="prefill"), N_DISAGG),
    ("pdcluster_worker_requests_total", lbl(worker="d0", role="decode"), sum(1 for i in OK_IDX if i % 2)),
    ("pdcluster_worker_requests_total", lbl(worker="d1", role="decode"), sum(1 for i in OK_IDX if i % 2 == 0)),
    ("pdcluster_redis_lookup_failures_total", (), 1),
    ("pdcluster_failovers_total", lbl(kind="prefill"), 2),
    ("pdcluster_failovers_total", lbl(kind="decode"), 1),
    ("pdcluster_retries_total", lbl(kind="decode"), 1),
])
def test_counters(fed: dict[tuple[str, Labels], float], name: str, labels: Labels, want: float) -> None:
    assert fed[(name, labels)] == want


def test_no_stray_series(fed: dict[tuple[str, Labels], float]) -> None:
    # The two statuses sum to all 20; no prefill-role series for "" and no prefill counter for the decode workers.
    assert sum(v for (n, _), v in fed.items() if n == "pdcluster_requests_total") == len(STATUSES)
    workers = {lb for (n, lb) in fed if n == "pdcluster_worker_requests_total"}
    assert workers == {lbl(worker="p0", role="prefill"), lbl(worker="d0", role="decode"),
                       lbl(worker="d1", role="decode")}


@pytest.mark.parametrize("name, labels, count, total", [
    ("pdcluster_time_to_first_token_seconds", (), N_OK, N_OK * TTFT_S),
    ("pdcluster_inter_token_latency_seconds", (), N_OK * len(ITL_S), N_OK * sum(ITL_S)),
    ("pdcluster_e2e_request_latency_seconds", (), N_OK + 1, N_OK * E2E_S + 1.5),
    ("pdcluster_kv_transfer_seconds", lbl(transport="grpc"), N_DISAGG, N_DISAGG * KV_S),
    ("pdcluster_redis_lookup_seconds", (), 2, 0.003),
])
def test_histograms(fed: dict[tuple[str, Labels], float], name: str, labels: Labels, count: int,
                    total: float) -> None:
    assert fed[(name + "_count", labels)] == count
    assert fed[(name + "_sum", labels)] == pytest.approx(total)
    assert fed[(name + "_bucket", lbl(**dict(labels), le="+Inf"))] == count


@pytest.mark.parametrize("name, labels, want", [
    ("pdcluster_router_inflight_requests", (), 7),
    ("pdcluster_worker_queue_depth", lbl(worker="p0", role="prefill"), 3),
    ("pdcluster_worker_running_requests", lbl(worker="p0", role="prefill"), 2),
    ("pdcluster_kv_blocks_used", lbl(worker="p0", role="prefill"), 40),
    ("pdcluster_kv_blocks_free", lbl(worker="p0", role="prefill"), 60),
    ("pdcluster_kv_blocks_cached", lbl(worker="p0", role="prefill"), 25),
    ("pdcluster_worker_up", lbl(worker="p0", role="prefill"), 1),
    ("pdcluster_worker_running_requests", lbl(worker="d0", role="decode"), 5),
    ("pdcluster_worker_up", lbl(worker="d0", role="decode"), 0),
])
def test_gauges(fed: dict[tuple[str, Labels], float], name: str, labels: Labels, want: float) -> None:
    assert fed[(name, labels)] == want


def test_a_missing_load_leaves_gauges_untouched() -> None:
    m = RouterMetrics()
    m.set_worker_load("d0", "decode", WorkerLoad(waiting=4, num_blocks=10, free_blocks=3, cached_blocks=1), True)
    m.set_worker_load("d0", "decode", None, alive=False)  # heartbeat gone: the last numbers stay
    got = samples(m)
    d0 = lbl(worker="d0", role="decode")
    assert got[("pdcluster_worker_queue_depth", d0)] == 4
    assert got[("pdcluster_kv_blocks_used", d0)] == 7
    assert got[("pdcluster_kv_blocks_free", d0)] == 3
    assert got[("pdcluster_kv_blocks_cached", d0)] == 1
    assert got[("pdcluster_worker_up", d0)] == 0


def test_two_routers_do_not_collide() -> None:
    a, b = RouterMetrics(), RouterMetrics()  # the same names twice in one process: no "Duplicated timeseries"
    a.request_done("grpc", "OK")
    a.request_done("grpc", "OK")
    b.request_done("grpc", "OK")
    b.set_inflight(3)
    ok = ("pdcluster_requests_total", lbl(api="grpc", status="OK"))
    assert samples(a)[ok] == 2 and samples(b)[ok] == 1
    assert samples(a)[("pdcluster_router_inflight_requests", ())] == 0


def test_names_follow_conventions() -> None:
    m = RouterMetrics()
    feed(m)
    names = [fam.name for fam in m.registry.collect()]
    ours = [n for n in names if n.startswith("pdcluster_")]
    vllm = [n for n in names if n.startswith("vllm:")]  # vLLM's model-server names, for tools built on them
    assert (len(ours), len(vllm), len(names)) == (30, 14, 44)
    text = m.render().decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    counters = [n for n, t in types.items() if t == "counter"]
    assert len(counters) == 19 and all(n.endswith("_total") for n in counters)
    for n, t in types.items():
        assert n.startswith(("pdcluster_", "vllm:"))
        # NOTE: the only other names are prometheus_client's standard `_created` series of counters/histograms.
        assert t in ("gauge", "histogram") or n in counters
    for fam in text_string_to_metric_families(text):
        if fam.type == "counter":
            assert all(s.name.endswith("_total") for s in fam.samples)


def test_metrics_server() -> None:
    async def main() -> None:
        m = RouterMetrics()
        feed(m)
        runner, port = await start_metrics_server(m, "127.0.0.1", 0)
        try:
            assert port > 0
            async with aiohttp.ClientSession() as http:
                async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"] == CONTENT_TYPE_LATEST
                    body = await resp.read()
                async with http.get(f"http://127.0.0.1:{port}/other") as resp:
                    assert resp.status == 404
            assert body == m.render()
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_the_ttft_prediction_error_is_exported_per_placement() -> None:
    m = RouterMetrics()
    m.observe_prediction("slo", 0.2, 0.3)  # 100 ms late
    m.observe_prediction("slo", 0.2, 0.1)  # 100 ms early
    m.observe_prediction("prefill_pool", 1.0, 1.5)
    got = samples(m)
    err = "pdcluster_ttft_prediction_error_seconds"
    # NOTE: signed observations: no _sum series (Prometheus' rule for histograms with negative buckets)
    assert got[(err + "_count", lbl(placement="slo"))] == 2
    assert got[(err + "_bucket", lbl(placement="slo", le="-0.1"))] == 1  # the early one
    assert got[(err + "_bucket", lbl(placement="slo", le="0.0"))] == 1
    assert got[(err + "_bucket", lbl(placement="slo", le="0.25"))] == 2  # and the late one
    assert got[(err + "_bucket", lbl(placement="prefill_pool", le="0.25"))] == 0
    assert got[(err + "_bucket", lbl(placement="prefill_pool", le="0.5"))] == 1
    # the moving mean of actual / predicted: 1.5, then 0.9 × 1.5 + 0.1 × 0.5
    assert got[("pdcluster_ttft_prediction_ratio", lbl(placement="slo"))] == pytest.approx(1.4)
    assert got[("pdcluster_ttft_prediction_ratio", lbl(placement="prefill_pool"))] == pytest.approx(1.5)


def test_a_requests_gaps_observed_at_once_fill_the_same_buckets_as_one_observe_each():
    """observe_all (one increment per bucket at a request's end) against prometheus_client's own observe per value:
    the same bucket counts, count and sum, values on a bucket's bound and past the last one included."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from router.histograms import ITL_BUCKETS_S, observe_all

    gaps = [0.0, 0.0004, 0.001, 0.0011, 0.005, 0.005, 0.02, 0.3, 4.9, 5.0, 7.5, 120.0] * 3
    texts = []
    for at_once in (False, True):
        r = CollectorRegistry()
        plain = Histogram("itl", "gaps", buckets=ITL_BUCKETS_S, registry=r)
        labelled = Histogram("itl_by_model", "gaps", ("model_name",), buckets=ITL_BUCKETS_S, registry=r).labels("m")
        for h in (plain, labelled):
            if at_once:
                observe_all(h, gaps)
                observe_all(h, [])
            else:
                for g in gaps:
                    h.observe(g)
        texts.append("\n".join(line for line in generate_latest(r).decode().splitlines() if "_created" not in line))
    assert texts[0] == texts[1]
    assert 'itl_bucket{le="0.001"} 9.0' in texts[1] and 'itl_bucket{le="+Inf"} 36.0' in texts[1]
