"""The handoff and a slow restart on the default cluster (deploy/local.yaml: one prefill, one decode worker).

1. Decoding starts when the KV lands, not when the router next calls: the router takes the first token and then
   holds the stream; the decode worker must run the request to its end meanwhile, and the tokens the router then
   relays must be an undisturbed greedy run's.
2. The prompt is computed while the decode worker has not answered the handshake yet (its layers wait for it).
3. A decode failover waits for a restarting worker: the only decode worker is killed mid-stream and Ray restarts it
   slowly (PDC_FAULT_RESTART_DELAY_S, the workers' fault-injection variable); every stream must still complete
   with exactly the tokens of an undisturbed run, none lost or repeated.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.faults import RESTART_DELAY_ENV
from engine import SamplingParams
from router.validate import Checked
from tests.helpers import greedy_reference, make_engine, start_test_cluster, stream_greedy

pytestmark = pytest.mark.slow
NS = "test-handoff"
RESTART_DELAY_S = 14.0  # NOTE: longer than the old failover's four tries at ~2 s each
HANG_S = 6.0  # the decode worker's engine held: its handshake answers only after it (far under the stall limit)


@pytest.fixture(scope="module")
def cluster(ray_session):
    def edit(config):
        config.decode.max_restarts = 1

    os.environ[RESTART_DELAY_ENV] = str(RESTART_DELAY_S)  # NOTE: read by the launcher when it starts the actors
    try:
        # NOTE: every request crosses the handoff: no prefix skip, and no SLO rule that has the decode worker
        # prefill a short prompt itself
        c, server = start_test_cluster("deploy/local.yaml", NS, edit=edit, port=0,
                                       skip_prefill_max_uncached_tokens=0, slo_itl_ms=None)
    finally:
        del os.environ[RESTART_DELAY_ENV]
    yield c, server
    server.close()
    c.stop()


def test_decoding_starts_when_the_kv_lands_not_when_the_router_calls(cluster, smollm2, ray_session):
    c, server = cluster
    text = f"A handoff that nobody waits for ({time.monotonic_ns()}): the river runs to the sea, and"
    want = greedy_reference(smollm2, [text], 200)[0]
    prompt = make_engine(smollm2, num_blocks=64).tokenize(text, "t")
    decode = c.actors["decode-0"]
    deadline = time.monotonic() + 60  # NOTE: both workers up (heartbeat and ping) first, or the route may skip one
    while not all(server.router.pools.is_up(n) for n in ("prefill-0", "decode-0")) and time.monotonic() < deadline:
        time.sleep(0.2)

    async def run() -> tuple[list[int], int]:
        computed = (await decode.load.remote()).computed_tokens
        chunks = server.router.stream(Checked(f"handoff-{time.monotonic_ns()}", prompt,
                                              SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)))
        first = await anext(chunks)  # the prefill worker's token; the router reads nothing more for now
        # NOTE: what the decode worker computed, a counter, not a sample of its running batch: under load the
        # machine stalls for seconds, and a request that decoded to its end before the first sample would never be
        # seen running (the race that once failed this test)
        # NOTE: the router reads nothing: the worker decodes up to its window of undelivered steps, then pauses the
        # sequence in its engine (cluster/backlog.py) until the router reads again. Under load the first pause can
        # come early and lift (Ray's window was not full yet), so wait until it holds: paused, nothing computed for 2 s
        decoded, paused, held_since = -1, 0, time.monotonic()
        deadline = held_since + 240  # NOTE: a bound for a hang, not a speed check
        while time.monotonic() < deadline:
            load = await decode.load.remote()
            now = load.computed_tokens - computed
            if now != decoded or not load.paused:
                decoded, paused, held_since = now, load.paused, time.monotonic()
            if (paused and time.monotonic() - held_since >= 2.0) or (load.running == 0 and decoded >= 199):
                break
            await asyncio.sleep(0.05)
        assert paused == 1, f"the unread stream was not paused ({decoded} decode steps)"
        rest = [chunk async for chunk in chunks]
        assert rest[-1].timeline is not None and rest[-1].timeline.prefill_worker == "prefill-0"  # the handoff
        return first.token_ids + [t for chunk in rest for t in chunk.token_ids], decoded

    tokens, decoded = asyncio.run_coroutine_threadsafe(run(), server.loop).result(400)
    # decode steps after the prefill worker's token, before the router asked for a single decode token, up to the
    # window (a client that reads nothing costs no decode steps past it); read again, the stream finishes
    window = server.router.settings.stream_buffer_chunks
    assert window <= decoded < 199, decoded
    assert tokens == want  # the relayed stream is an undisturbed greedy run, every token once


def test_the_prompt_is_computed_while_the_decode_worker_has_not_yet_answered_the_handshake(cluster, smollm2,
                                                                                            ray_session):
    """The handshake and the prefill overlap: with the decode worker's engine held (its reservation waits for a
    step boundary), the prefill worker computes the prompt at once; its layers wait for the answer, and the request
    still ends with an undisturbed greedy run's tokens."""
    c, server = cluster
    text = f"Layers that wait for an answer ({time.monotonic_ns()}): the lighthouse keeper counted the ships, and"
    want = greedy_reference(smollm2, [text], 24)[0]
    prefill, decode = c.actors["prefill-0"], c.actors["decode-0"]
    deadline = time.monotonic() + 60
    while not all(server.router.pools.is_up(n) for n in ("prefill-0", "decode-0")) and time.monotonic() < deadline:
        time.sleep(0.2)
    before = ray_session.get(prefill.load.remote(), timeout=30).computed_tokens
    ray_session.get(decode.debug_hang.remote(HANG_S), timeout=60)  # NOTE: returns once the loop is held
    held_until = time.monotonic() + HANG_S
    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(stream_greedy, server, [text], 24, "held")
        computed = 0
        while time.monotonic() < held_until - 0.5 and computed == 0:
            computed = ray_session.get(prefill.load.remote(), timeout=30).computed_tokens - before
            time.sleep(0.05)
        still_held = time.monotonic() < held_until
        (tokens, last), = run.result(timeout=300)
    assert computed > 0 and still_held, "the prompt waited for the decode worker's answer before it was computed"
    assert tokens == want
    assert last.timeline.prefill_worker == "prefill-0" and not last.timeline.prefill_skipped


def test_a_failover_waits_for_the_only_decode_worker_to_restart(cluster, smollm2, ray_session):
    c, server = cluster
    texts = [f"Slow restart {i}: the keeper lit the lamp and watched the ships until" for i in range(4)]
    want = greedy_reference(smollm2, texts, 48)
    started = threading.Event()
    with ThreadPoolExecutor(1) as bg:
        fut = bg.submit(stream_greedy, server, texts, 48, "slow", started)
        assert started.wait(120)
        ray_session.kill(ray_session.get_actor("decode-0", namespace=NS), no_restart=False)
        killed = time.monotonic()
        results = fut.result(timeout=600)
    waited = time.monotonic() - killed
    for (ids, last), ref in zip(results, want):
        assert ids == ref  # every token once, in order, equal to an undisturbed run
        assert last.usage.completion_tokens == 48 and last.finish_reason == "length"
    assert waited >= RESTART_DELAY_S  # NOTE: not a speed check: the streams did outlive the restart
    assert server.router.metrics.registry.get_sample_value("pdcluster_failovers_total", {"kind": "decode"}) >= 1
