"""The autoscaler on a real local cluster (Ray actors, SmolLM2, the embedded Redis): documents that one prefill worker
cannot keep within the TTFT SLO make it add a prefill worker through the real scale path, and no request fails."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

import pytest

from pdcluster.autoscale_loop import AutoscaleLoop
from pdcluster.bench.runner import run_workload
from pdcluster.bench.stats import RequestRecord
from pdcluster.bench.workloads import Session, Turn, Workload
from pdcluster.config import AutoscalerConfig
from router.scaling import PoolScaler
from tests.helpers import start_test_cluster

DOCS, DOC_TOKENS = 8, 800


def documents(seed: int, n: int = DOCS) -> Workload:
    """`n` unique 800-token prompts sent 0.1 s apart, 4 tokens each: ~20 s of prefill work for one core (DOCS)."""
    rng = random.Random(seed)
    sessions = tuple(Session(i, 0.1 * i, (Turn(tuple(rng.randrange(256, 49152) for _ in range(DOC_TOKENS)), 4),))
                     for i in range(n))
    return Workload("documents", 10.0, sessions)


@pytest.mark.slow
def test_documents_make_the_autoscaler_add_a_prefill_worker_with_no_request_failed(ray_session):
    def edit(cfg: Any) -> None:
        # NOTE: the test drives the evaluations itself (tick), so no interval or cooldown gets in the way
        cfg.autoscaler = AutoscalerConfig(enabled=True, max_workers=3, interval_s=3600, window_s=30, cooldown_s=0,
                                          min_requests=4, up_evaluations=2, down_evaluations=2)

    # NOTE: the SLO placement rule off (slo_itl_ms None), so every document crosses the prefill -> decode handoff;
    # no admission limit (a loaded machine predicts a long backlog): the test counts failures, not refusals
    c, server = start_test_cluster("deploy/local.yaml", "test-autoscale", edit=edit, port=0, slo_ttft_ms=3000,
                                   slo_itl_ms=None, max_predicted_ttft_ms=600_000)
    loop = server.loop

    def on_loop(coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def make() -> AutoscaleLoop:
        return AutoscaleLoop(c.config, server.router, PoolScaler(server.router, c))

    records: list[RequestRecord] = []
    sender = threading.Thread(target=lambda: records.extend(asyncio.run(run_workload(server.address,
                                                                                     documents(1)))[0]))
    try:
        auto = on_loop(make())
        assert auto.scaler.counts() == (1, 1)
        sender.start()
        # NOTE: the evaluation calibrates on what the workers measured: wait for the prefill worker's first steps
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (auto.step_costs().prefill and
                                                   server.router.traffic.snapshot(30).arrivals == DOCS):
            time.sleep(0.2)
        first = on_loop(auto.tick())
        second = on_loop(auto.tick(), timeout=240)  # NOTE: applies the change: a new worker loads and warms up
        sender.join(300)
        assert first is not None and first.action == "hold" and first.plan is not None and first.plan.prefill >= 2
        assert second is not None and second.action == "up" and second.apply == (2, 1), second.reason
        assert auto.scaler.counts() == (2, 1) and "prefill-1" in server.router.pools.by_name
        assert len(records) == DOCS and all(r.ok for r in records), [r.error for r in records if not r.ok]
        # the new worker takes requests: later documents are prefilled there too
        # NOTE: once the router counts it up (answered pings, a heartbeat): on a loaded machine that can come after
        # the next documents are all placed (they arrive within 0.8 s), which would test the pinger's timing instead
        pools = server.router.pools
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (pools.is_up("prefill-1") and pools["prefill-1"].view.load):
            time.sleep(0.1)
        # NOTE: 4 documents within 0.3 s: the second already finds prefill-0 computing the first
        more: list[RequestRecord] = asyncio.run(run_workload(server.address, documents(2, 4)))[0]
        assert all(r.ok for r in more) and "prefill-1" in {r.prefill_worker for r in more}, \
            f"{[(r.prefill_worker, r.error) for r in more]} up={pools.is_up('prefill-1')} " \
            f"{pools['prefill-1'].view} {pools['prefill-0'].view}"  # NOTE: a str, which pytest does not cut short
        text = server.router.metrics.render().decode()
        assert 'pdcluster_autoscaler_decisions_total{action="up"} 1.0' in text
        assert 'pdcluster_autoscaler_target_workers{pool="prefill"} 2.0' in text
    finally:
        server.close()
        c.stop()
