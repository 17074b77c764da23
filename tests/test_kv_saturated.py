"""A saturated cluster computes each prompt once (issue 19 item 4): the KV transfer's deadline runs from its first
layer, not from the handshake made before the prompt queued for prefill.

One prefill and one decode worker (deploy/local.yaml) with a 4 s transfer deadline get 14 unique prompts at once;
the prefill worker computes them one after another, so most wait far longer than the deadline. Every request must
complete with each prompt prefilled once, on the prefill worker, and none on the decode worker.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from router.v1 import inference_pb2 as pb
from tests.helpers import start_test_cluster

pytestmark = pytest.mark.slow
NS = "test-kv-saturated"
DEADLINE_S = 4.0  # NOTE: first layer → taken on the decode worker fits in it on a loaded 2-core machine
STORY = ("The harbour master kept a ledger of every ship that entered the bay: its name, its cargo, the weather, and "
         "the hour the tide turned. ")


@pytest.fixture(scope="module")
def cluster(ray_session):
    def edit(config):
        config.transfer.deadline_s = DEADLINE_S
        config.prefill.max_num_batched_tokens = 256  # NOTE: one prompt at a time: the backlog grows with each one
        # NOTE: every prompt on the prefill pool, however long its queue (the placement rule would move some of the
        # backlog to the decode pool's chunked path: tests/test_router_unit.py covers that choice)
        config.router.slo_itl_ms = None

    c, server = start_test_cluster("deploy/local.yaml", NS, edit=edit, port=0)
    yield c, server
    server.close()
    c.stop()


def test_a_saturated_cluster_prefills_each_prompt_once(cluster, ray_session):
    c, server = cluster
    stub = server.stub()
    prompts = [f"Ledger {i}: " + STORY * 14 + f"Which ship came in on day {i}?" for i in range(14)]
    before = {name: ray_session.get(c.actors[name].load.remote(), timeout=30) for name in ("prefill-0", "decode-0")}

    def one(i: int) -> pb.GenerateResponse:
        return stub.Generate(pb.GenerateRequest(
            request_id=f"sat-{i}", prompt=prompts[i],
            sampling=pb.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)), timeout=300)

    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(one, range(len(prompts))))
    after = {name: ray_session.get(c.actors[name].load.remote(), timeout=30) for name in ("prefill-0", "decode-0")}
    assert all(len(r.token_ids) == 4 for r in responses)
    assert all(not r.timeline.prefill_skipped and r.timeline.prefill_worker == "prefill-0" for r in responses)
    prompt_tokens = sum(r.usage.prompt_tokens for r in responses)
    # each prompt computed once on the prefill worker (a retried prefill counts its prompt again) ...
    prefill = after["prefill-0"].prompt_tokens - before["prefill-0"].prompt_tokens
    assert prefill == prompt_tokens
    assert after["prefill-0"].cached_prompt_tokens == before["prefill-0"].cached_prompt_tokens
    # ... and never on the decode worker (its fallback after the retries)
    assert after["decode-0"].prompt_tokens == before["decode-0"].prompt_tokens
    assert server.router.metrics.retries.labels(kind="prefill")._value.get() == 0
    # ... though the cluster was saturated: prompts waited for prefill longer than the transfer deadline
    assert max(r.timeline.queue_ms for r in responses) > 1.5 * DEADLINE_S * 1000, [r.timeline for r in responses]
