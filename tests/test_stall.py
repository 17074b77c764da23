"""A decode worker whose engine hangs is failed over like a dead one, and avoided until it beats again.

One prefill and two decode workers, the router's stall timeout lowered to a few seconds. While greedy streams run,
the decode worker holding most of them is made to hang (`debug_hang`: the fault-injection method that holds its
real engine loop). Every stream must complete with exactly an undisturbed run's tokens, new requests must go to
the other worker while it hangs, and once the hang ends it must be back in service with its KV blocks all free.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import greedy_reference, start_test_cluster, stream_greedy

pytestmark = pytest.mark.slow
NS = "test-stall"
HANG_S = 25.0  # NOTE: the failover and the 4 requests after it took ~6 s of it alone on this machine


@pytest.fixture(scope="module")
def cluster(ray_session):
    def edit(config):
        config.decode.replicas = 2

    c, server = start_test_cluster("deploy/local.yaml", NS, edit=edit, port=0, skip_prefill_max_uncached_tokens=0,
                                   stall_timeout_steps=20.0, stall_timeout_min_s=3.0)
    yield c, server
    server.close()
    c.stop()


def test_a_hung_decode_worker_is_failed_over_and_avoided_until_it_beats_again(cluster, smollm2, ray_session):
    c, server = cluster
    pools = server.router.pools
    texts = [f"Stall {i}: the lighthouse keeper climbed the stairs, lit the lamp, and" for i in range(6)]
    want = greedy_reference(smollm2, texts, 48)
    started = threading.Event()
    with ThreadPoolExecutor(1) as bg:
        fut = bg.submit(stream_greedy, server, texts, 48, "stall", started)
        assert started.wait(120)
        running = {n: ray_session.get(c.actors[n].load.remote(), timeout=30).running for n in ("decode-0", "decode-1")}
        victim = max(running, key=running.get)
        ray_session.get(c.actors[victim].debug_hang.remote(HANG_S), timeout=60)
        hung_at = time.monotonic()
        results = fut.result(timeout=600)
    for (ids, last), ref in zip(results, want):
        assert ids == ref  # every token once, in order, equal to an undisturbed run
        assert last.usage.completion_tokens == 48 and last.finish_reason == "length"
    assert server.router.metrics.registry.get_sample_value("pdcluster_failovers_total", {"kind": "decode"}) >= 1
    assert not pools.is_up(victim)

    # while it hangs, new requests go to the other decode worker
    fresh = [f"After the stall {i} ({time.monotonic_ns()}): the ships passed the rocks and" for i in range(4)]
    later = stream_greedy(server, fresh, 8, tag="stall")
    assert not pools.is_up(victim) and time.monotonic() - hung_at < HANG_S  # NOTE: these ran during the hang
    assert all(last.timeline.decode_worker != victim for _, last in later)

    # the hang ends: it beats again, is back in service, and the aborted streams left no block behind
    deadline = time.monotonic() + HANG_S + 90
    while not pools.is_up(victim) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pools.is_up(victim)
    # NOTE: what the hang held up runs when it ends, beside the worker's first heartbeat: the router's aborts of the
    # stalled streams and the handshakes that waited for the engine (each refused or freed as its sender gave it
    # up): a few seconds, where a leaked reservation would stay until its transfer's deadline (transfer.deadline_s: 30)
    settled = time.monotonic() + 10
    while True:
        load = ray_session.get(c.actors[victim].load.remote(), timeout=30)
        if (load.running, load.reserved) == (0, 0) or time.monotonic() > settled:
            break
        time.sleep(0.25)
    assert (load.running, load.reserved, load.free_blocks) == (0, 0, load.num_blocks)
