"""Every transport a cluster can run carries the prefill → decode handoff token-exact and leaves nothing reserved.

The shipped YAMLs run `nixl`, so every other cluster test (text integrity, failover, decode handoff, stall) runs it;
here the default cluster (deploy/local.yaml, one prefill and one decode worker, prefix skipping off so every request
crosses the handoff) runs each transport in turn: fresh prompts streamed at once must give an undisturbed greedy
run's tokens, each through the prefill worker, the decode worker's receiver must be on that transport (not fallen
back to grpc), and once the streams end it must hold no reservation and no running request.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers import greedy_reference, start_test_cluster, stream_greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 12
# the decode worker's KVReceiver.transport: the transport whose receiver hooks it runs ("" for grpc: none)
RECEIVER_HOOKS = {"grpc": "", "torch": "torch", "nixl": "nixl"}


@pytest.fixture(scope="module", params=["grpc", "torch", "nixl"])
def cluster(request, ray_session):
    transport = request.param

    def edit(config):
        config.transfer.transport = transport

    c, server = start_test_cluster("deploy/local.yaml", f"test-handoff-{transport}", edit=edit, port=0,
                                   skip_prefill_max_uncached_tokens=0, slo_itl_ms=None)
    yield c, server, transport
    server.close()
    c.stop()


def test_each_transport_carries_the_handoff_token_exact_and_frees_everything(cluster, smollm2, ray_session):
    c, server, transport = cluster
    decode = c.actors["decode-0"]
    hooks = ray_session.get(decode.__ray_call__.remote(lambda actor: actor.worker.receiver.transport), timeout=30)
    assert hooks == RECEIVER_HOOKS[transport], f"the decode worker does not receive over {transport}"
    texts = [f"Over {transport} {i} ({time.monotonic_ns()}): the river ran past the mill, and the miller"
             for i in range(4)]
    want = greedy_reference(smollm2, texts, MAX_TOKENS)
    results = stream_greedy(server, texts, MAX_TOKENS, tag=f"handoff-{transport}")
    for (ids, last), ref in zip(results, want):
        assert ids == ref
        assert last.timeline.prefill_worker == "prefill-0" and last.timeline.kv_bytes_sent > 0  # the KV crossed
    deadline = time.monotonic() + 30  # NOTE: a bound for a leak, not a speed check: the router may end first
    while time.monotonic() < deadline:
        load = ray_session.get(decode.load.remote(), timeout=30)
        if (load.running, load.reserved) == (0, 0):
            break
        time.sleep(0.1)
    assert (load.running, load.reserved) == (0, 0)
