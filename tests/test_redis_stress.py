"""Redis slow, full or shared with a zombie (issue 19 item 7), against real redis-servers: a test-only embedded one
that keeps DEBUG and CONFIG (the cluster's own has neither) is made slow with DEBUG SLEEP and full with maxmemory."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from cluster.messages import WorkerLoad
from cluster.prefix_index import PrefixIndex
from cluster.redis_breaker import RedisBreaker, RedisUnavailable
from cluster.worker import WorkerSpec
from decode_workers.worker import DecodeWorker
from engine import EngineConfig
from kv_transfer.state import TransferConfig
from pdcluster.redis_server import EmbeddedRedis, connect
from tests.helpers import wait_for

CFG = EngineConfig(num_blocks=64, num_threads=1)


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(admin_commands=True) as s:
        yield s


@pytest.fixture
def admin(server: EmbeddedRedis) -> Iterator[redis.Redis]:
    c = connect(server.url, timeout_s=30)
    yield c
    c.config_set("maxmemory", 0)
    c.close()


def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def asleep(admin_url: str, seconds: float) -> threading.Thread:
    """Block the whole Redis server for `seconds` (DEBUG SLEEP, on a connection of its own); returns at once."""
    def sleep() -> None:
        c = connect(admin_url, timeout_s=seconds + 10)
        c.execute_command("DEBUG", "SLEEP", str(seconds))
        c.close()
    t = threading.Thread(target=sleep, daemon=True)
    t.start()
    time.sleep(0.2)  # NOTE: until the server took the command; it answers nobody while it sleeps
    return t


def test_a_slow_redis_trips_the_breaker_then_calls_fail_fast_and_it_closes_when_redis_answers(server, caplog):
    caplog.set_level(logging.WARNING, logger="cluster.redis_breaker")
    breaker = RedisBreaker("router", threshold=3, slow_s=0.2, cooldown_s=0.5)
    index = PrefixIndex(connect(server.url, timeout_s=0.3), prefix(), breaker)
    registry = CollectorRegistry()
    registry.register(breaker)
    assert index.lookup([hashlib.sha256(b"x").digest()]) == {}
    sleeper = asleep(server.url, 2.0)
    outcomes = []
    for _ in range(6):
        try:
            index.lookup([hashlib.sha256(b"x").digest()])
            outcomes.append("ok")
        except RedisUnavailable:
            outcomes.append("fast")
        except redis.RedisError:
            outcomes.append("timeout")
    assert outcomes == ["timeout"] * 3 + ["fast"] * 3  # three waits, then no caller waits on the socket
    assert registry.get_sample_value("pdcluster_redis_breaker_open", {"client": "router"}) == 1
    assert registry.get_sample_value("pdcluster_redis_errors_total", {"client": "router", "kind": "timeout"}) == 3
    assert registry.get_sample_value("pdcluster_redis_rejected_total", {"client": "router"}) == 3
    assert any("breaker open" in r.getMessage() for r in caplog.records)
    sleeper.join(10)
    assert wait_for(lambda: _answers(index), timeout=10)  # the half-open probe finds Redis back
    assert breaker.state == "closed" and registry.get_sample_value("pdcluster_redis_breaker_open",
                                                                   {"client": "router"}) == 0
    assert any("breaker closed" in r.getMessage() for r in caplog.records)


def _answers(index: PrefixIndex) -> bool:
    try:
        index.lookup([hashlib.sha256(b"x").digest()])
        return True
    except redis.RedisError:
        return False


def test_a_zombie_heartbeat_with_an_older_epoch_does_not_overwrite_the_restarted_worker(server):
    index = PrefixIndex(connect(server.url), prefix())
    old = index.register_worker("decode-0")
    assert index.heartbeat("decode-0", old, "decode", "10.0.0.1:7000", WorkerLoad())
    new = index.register_worker("decode-0")  # Ray restarted the worker; the old process still runs
    assert index.heartbeat("decode-0", new, "decode", "10.0.0.2:7000", WorkerLoad())
    assert not index.heartbeat("decode-0", old, "decode", "10.0.0.1:7000", WorkerLoad())  # the zombie beats
    (w,) = index.workers()
    assert (w.address, w.epoch) == ("10.0.0.2:7000", new)
    assert index.renew_epoch("decode-0", old) is None  # nor can it take the name back
    assert index.current_epoch("decode-0") == new
    assert index.renew_epoch("decode-0", new) == new + 1  # the current incarnation can (after a Redis outage)


def decode_worker(loaded, url: str, key_prefix: str) -> DecodeWorker:
    return DecodeWorker(WorkerSpec("decode-0", "decode", "tiny", CFG, TransferConfig(), url, key_prefix), loaded)


def test_a_zombie_worker_stops_writing_once_a_new_incarnation_registered(tiny, server, caplog):
    caplog.set_level(logging.ERROR, logger="cluster.worker")
    key_prefix = prefix()
    index = PrefixIndex(connect(server.url), key_prefix)
    zombie = decode_worker(tiny, server.url, key_prefix)
    try:
        assert wait_for(lambda: [w.address for w in index.workers()] == [zombie.kv_address])
        restarted = decode_worker(tiny, server.url, key_prefix)
        try:
            assert restarted.kv_address != zombie.kv_address and restarted.epoch == zombie.epoch + 1
            seen = set()
            for _ in range(30):  # 1.5 s: three heartbeats of each
                seen |= {(w.address, w.epoch) for w in index.workers()}
                time.sleep(0.05)
            assert seen <= {(restarted.kv_address, restarted.epoch), (zombie.kv_address, zombie.epoch)}
            assert wait_for(lambda: zombie._superseded)
            assert [(w.address, w.epoch) for w in index.workers()] == [(restarted.kv_address, restarted.epoch)]
            assert index.current_epoch("decode-0") == restarted.epoch  # the zombie did not take the name back
            assert any("newer incarnation" in r.getMessage() for r in caplog.records)
        finally:
            restarted.close()
    finally:
        zombie.close()


def test_a_full_redis_shows_in_the_workers_breaker_metric_and_log_and_heals(tiny, server, admin, caplog):
    caplog.set_level(logging.ERROR, logger="cluster.redis_breaker")
    key_prefix = prefix()
    index = PrefixIndex(connect(server.url), key_prefix)
    worker = decode_worker(tiny, server.url, key_prefix)
    registry = worker.metrics.registry
    try:
        assert wait_for(lambda: len(index.workers()) == 1)
        admin.config_set("maxmemory", 1)  # every write is refused: OOM command not allowed
        assert wait_for(lambda: (registry.get_sample_value("pdcluster_redis_breaker_open",
                                                           {"client": "decode-0"}) == 1))
        assert registry.get_sample_value("pdcluster_redis_errors_total", {"client": "decode-0", "kind": "full"}) >= 3
        assert any("Redis is full (maxmemory)" in r.getMessage() for r in caplog.records)
        assert wait_for(lambda: index.workers() == [], timeout=15)  # what the breaker explains: the beat expired
        admin.config_set("maxmemory", 0)
        assert wait_for(lambda: len(index.workers()) == 1)  # the worker is back on its own
        assert wait_for(lambda: registry.get_sample_value("pdcluster_redis_breaker_open", {"client": "decode-0"}) == 0)
    finally:
        worker.close()


@pytest.mark.slow
def test_in_a_cluster_a_slow_redis_trips_the_routers_breaker_and_requests_keep_flowing(ray_session, server,
                                                                                       monkeypatch, caplog):
    from router.v1 import inference_pb2 as pb
    from tests.helpers import start_test_cluster

    caplog.set_level(logging.WARNING, logger="cluster.redis_breaker")
    monkeypatch.setenv("PDC_TEST_STRESS_REDIS_PW", server.password or "")

    def edit(config):
        config.model = "tiny"
        config.redis.url = f"redis://127.0.0.1:{server.port}/0"
        config.redis.password_env = "PDC_TEST_STRESS_REDIS_PW"
        config.redis.key_prefix = prefix()
        for pool in (config.prefill, config.decode):
            pool.num_cpus, pool.num_kv_blocks = 0.5, 256

    c, rs = start_test_cluster("deploy/local.yaml", "test-redis-stress", edit=edit, port=0)
    stub, done, finished, failures = rs.stub(), threading.Event(), [], []

    def traffic(k: int) -> None:
        i = 0
        while not done.is_set():
            i += 1
            try:
                # NOTE: longer than a KV block (16 tokens), so each request looks its prompt up in Redis
                prompt = f"Client {k} asks question number {i} of many, and waits for the answer. " * 3
                r = stub.Generate(pb.GenerateRequest(prompt=prompt,
                                                     sampling=pb.SamplingParams(max_tokens=4, temperature=0,
                                                                                ignore_eos=True)), timeout=60)
                assert r.usage.completion_tokens == 4
                finished.append(time.monotonic())
            except Exception as e:  # noqa: BLE001 - every failure is reported below
                failures.append(repr(e))

    threads = [threading.Thread(target=traffic, args=(k,), daemon=True) for k in range(2)]
    try:
        for t in threads:
            t.start()
        assert wait_for(lambda: len(finished) >= 4, timeout=60)
        breaker = rs.router.index.breaker
        started = time.monotonic()
        asleep(server.url, 4.0).join(30)  # Redis answers nobody for 4 s
        ended = time.monotonic()
        assert wait_for(lambda: breaker.state == "closed", timeout=30)
        time.sleep(1.0)
    finally:
        done.set()
        for t in threads:
            t.join(60)
        rs.close()
        c.stop()
    assert failures == []
    assert any(started < t < ended for t in finished)  # requests went on while Redis slept
    assert breaker.opened >= 1 and breaker.rejected > 0  # ... without waiting on it once the breaker opened
    registry = rs.router.metrics.registry
    assert registry.get_sample_value("pdcluster_redis_errors_total", {"client": "router", "kind": "timeout"}) >= 1
    assert any("breaker open" in r.getMessage() for r in caplog.records)
    assert len(finished) > sum(1 for t in finished if t < started)  # and after it woke up
