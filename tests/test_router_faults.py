"""The router's own fault handling without a cluster: deadlines, clock skew, the front door's caps."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from cluster.messages import WorkerLoad
from cluster.prefix_index import PrefixIndex
from router.errors import DeadlineExceeded, Overloaded, Status, status_of
from router.pinger import HeartbeatAges
from router.validate import PromptRequest, RequestValidator
from tests.unit_router import unit_router


def run_until_refused(router, req, budget_s: float) -> BaseException:
    async def go() -> BaseException:
        try:
            async for _ in router.stream(req, budget_s=budget_s):
                pass
        except Exception as e:  # noqa: BLE001 - the refusal under test
            return e
        raise AssertionError("the request was admitted")
    return asyncio.run(go())


def test_a_deadline_an_idle_cluster_cannot_meet_is_deadline_exceeded_not_overload(tiny):
    router = unit_router(tiny)
    req = RequestValidator(router.info).prompt(PromptRequest("r1", prompt_token_ids=[5] * 1000))
    err = run_until_refused(router, req, 0.05)
    assert isinstance(err, DeadlineExceeded) and status_of(err)[0] is Status.DEADLINE_EXCEEDED
    assert router.inflight == 0
    # NOTE: the same deadline missed only because of the queue ahead is load: the client may retry elsewhere
    router.pools["prefill-0"].view.pending_tokens = 200_000
    err = run_until_refused(router, req, 5.0)
    assert isinstance(err, Overloaded) and status_of(err)[0] is Status.RESOURCE_EXHAUSTED
    assert router.inflight == 0


def test_heartbeat_ages_use_the_routers_clock_only():
    ages = HeartbeatAges()
    # NOTE: worker clocks 10 s ahead and 10 s behind: a fresh beat is young whatever it says
    assert ages.update({"a": (1, 1e9 + 10), "b": (1, 1e9 - 10)}, now=100.0) == {"a": 0.0, "b": 0.0}
    assert ages.update({"a": (1, 1e9 + 10.5), "b": (1, 1e9 - 10)}, now=103.0) == {"a": 0.0, "b": 3.0}
    assert ages.update({"a": (1, 1e9 + 10.5), "b": (2, 1e9 - 10)}, now=106.0) == {"a": 3.0, "b": 0.0}
    assert ages.update({"b": (2, 1e9 - 10)}, now=107.0) == {"b": 1.0}  # a's key expired: forgotten
    assert ages.age("a") is None


@pytest.fixture(scope="module")
def redis_client() -> Iterator[object]:
    from pdcluster.redis_server import EmbeddedRedis, connect

    with EmbeddedRedis() as server:
        client = connect(server.url)
        yield client
        client.close()


def test_workers_whose_clocks_are_10_s_off_are_routed_to_and_health_stays_green(tiny, redis_client):
    router = unit_router(tiny)
    prefix = f"t{uuid.uuid4().hex[:12]}"
    router.index = PrefixIndex(redis_client, prefix)
    stop = threading.Event()

    def beat(name: str, role: str, skew_s: float) -> None:
        index = PrefixIndex(redis_client, prefix)
        index.clock = lambda: time.time() + skew_s  # this node's clock is off
        epoch = index.register_worker(name)
        while not stop.is_set():
            index.heartbeat(name, epoch, role, f"{name}:1", WorkerLoad(num_blocks=1000, free_blocks=1000))
            stop.wait(0.2)

    threads = [threading.Thread(target=beat, args=("prefill-0", "prefill", 10.0)),
               threading.Thread(target=beat, args=("decode-0", "decode", -10.0))]
    for t in threads:
        t.start()

    async def watch() -> tuple[bool, set[str], float]:
        task = asyncio.create_task(router._refresh_loads())  # NOTE: no pinger: these workers have no actors
        try:
            await asyncio.sleep(1.5)
            return router.healthy(), {n for n in router.pools.by_name if router.pools.is_up(n)}, \
                (await router.status()).workers[1].heartbeat_age_s
        finally:
            task.cancel()
    try:
        healthy, up, age = asyncio.run(watch())
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert healthy and up == {"prefill-0", "decode-0"}
    assert age < 1.0  # decode-0's beat is young by the router's clock, though it says it is 10 s old
    route = router.pools.route(100, 8, {})
    assert (route.prefill, route.decode) == ("prefill-0", "decode-0")
