"""The Redis prefix index against a real embedded redis-server: schema, epochs, lookups, heartbeats, counters."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import redis

from cluster import prefix_index
from cluster.messages import WorkerLoad
from cluster.prefix_index import PrefixIndex
from pdcluster.redis_server import EmbeddedRedis, connect


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    with EmbeddedRedis() as server:
        c = connect(server.url)
        yield c
        c.close()


@pytest.fixture
def index(client: redis.Redis) -> PrefixIndex:
    """An index under a fresh prefix, so tests never see each other's keys."""
    return PrefixIndex(client, prefix=f"t{uuid.uuid4().hex[:12]}")


def h(i: int) -> bytes:
    """The i-th test block hash (32 bytes, like the engine's)."""
    return hashlib.sha256(f"block-{i}".encode()).digest()


def start_worker(index: PrefixIndex, name: str, held: list[bytes], role: str = "prefill") -> int:
    """Register `name`, heartbeat it and publish `held`; its epoch."""
    epoch = index.register_worker(name)
    index.heartbeat(name, epoch, role, f"{name}:50051", WorkerLoad())
    assert index.publish(name, epoch, held, [])
    return epoch


def fields_of(client: redis.Redis, key: str) -> set[str]:
    return {k.decode() for k in client.hkeys(key)}  # type: ignore[union-attr]


# ---- EmbeddedRedis ----

def test_embedded_redis_starts_answers_and_stops() -> None:
    server = EmbeddedRedis().start()
    try:
        assert server.url.endswith(f"@127.0.0.1:{server.port}/0")  # a fresh password per start
        c = connect(server.url)
        assert c.ping()
        c.set(b"k", b"v")
        assert c.get(b"k") == b"v"
        c.close()
        pid = server.pid
        assert psutil.pid_exists(pid)
    finally:
        server.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    server.stop()  # idempotent


def test_embedded_redis_password() -> None:
    with EmbeddedRedis(password="s3cret/:@") as server:
        assert server.url.startswith("redis://:s3cret%2F%3A%40@127.0.0.1:")
        assert connect(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            connect(f"redis://127.0.0.1:{server.port}/0").get(b"k")


def test_embedded_redis_dies_with_a_sigkilled_parent_and_the_next_start_removes_its_files() -> None:
    code = ("import os, signal; from pdcluster.redis_server import EmbeddedRedis; "
            "r = EmbeddedRedis().start(); print(r.pid, r._dir, r._password_file, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == -9, out.stderr
    pid_text, directory, password_path = out.stdout.split()
    pid = int(pid_text)
    assert os.path.isdir(directory) and os.path.isfile(password_path)  # nothing ran to remove them
    with EmbeddedRedis() as other:  # NOTE: a live server's files stay
        assert not os.path.exists(directory) and not os.path.exists(password_path)
        with EmbeddedRedis():
            assert os.path.isdir(other._dir) and os.path.isfile(other._password_file)  # type: ignore[arg-type]
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.05)
    else:
        psutil.Process(pid).kill()
        pytest.fail(f"redis-server {pid} outlived its SIGKILLed parent")


def test_embedded_redis_reports_a_failed_start() -> None:
    with EmbeddedRedis() as first:
        with pytest.raises(RuntimeError, match="Address already in use"):
            EmbeddedRedis(port=first.port).start()


# ---- lookup ----

def test_lookup_counts_leading_blocks_per_worker(index: PrefixIndex) -> None:
    start_worker(index, "w1", [h(0), h(1), h(2)])
    start_worker(index, "w2", [h(0), h(2)])
    assert index.lookup([h(0), h(1), h(2), h(3)]) == {"w1": 3, "w2": 1}
    assert index.lookup([h(1), h(2)]) == {"w1": 2}
    assert index.lookup([h(2)]) == {"w1": 1, "w2": 1}


@pytest.mark.parametrize("hashes", [[], [h(7)], [h(7), h(0)]])
def test_lookup_without_entries_is_empty(index: PrefixIndex, hashes: list[bytes]) -> None:
    start_worker(index, "w1", [h(0)])
    assert index.lookup(hashes) == {}


def test_lookup_ignores_a_dead_worker(index: PrefixIndex, client: redis.Redis) -> None:
    start_worker(index, "alive", [h(0), h(1)])
    start_worker(index, "dead", [h(0), h(1)])
    client.delete(f"{index.prefix}:hb:dead")
    assert index.lookup([h(0), h(1)]) == {"alive": 2}
    # NOTE: a missing heartbeat is not a stale epoch: the entries stay, the worker may beat again.
    assert "dead" in fields_of(client, f"{index.prefix}:blk:{h(0).hex()}")


def test_eviction_shrinks_lookup(index: PrefixIndex, client: redis.Redis) -> None:
    epoch = start_worker(index, "w1", [h(0), h(1), h(2)])
    assert index.publish("w1", epoch, [], [h(1)])
    assert index.lookup([h(0), h(1), h(2)]) == {"w1": 1}
    assert fields_of(client, f"{index.prefix}:blk:{h(1).hex()}") == set()
    assert client.smembers(f"{index.prefix}:wblk:w1") == {h(0).hex().encode(), h(2).hex().encode()}


def test_publish_sets_block_ttl(index: PrefixIndex, client: redis.Redis) -> None:
    start_worker(index, "w1", [h(0)])
    for key in (f"{index.prefix}:blk:{h(0).hex()}", f"{index.prefix}:wblk:w1"):
        ttl: Any = client.ttl(key)
        assert prefix_index.BLOCK_TTL_S - 5 <= ttl <= prefix_index.BLOCK_TTL_S
    assert client.ttl(f"{index.prefix}:epoch:w1") == -1


# ---- epochs ----

def test_restart_purges_old_entries_and_ignores_stale_writes(index: PrefixIndex, client: redis.Redis) -> None:
    old = start_worker(index, "w1", [h(0), h(1)])
    start_worker(index, "w2", [h(0)])
    new = index.register_worker("w1")
    assert new == old + 1
    assert index.lookup([h(0), h(1)]) == {"w2": 1}
    assert fields_of(client, f"{index.prefix}:blk:{h(0).hex()}") == {"w2"}
    assert fields_of(client, f"{index.prefix}:blk:{h(1).hex()}") == set()
    assert not client.exists(f"{index.prefix}:wblk:w1")
    assert index.publish("w1", old, [h(5)], []) is False
    assert fields_of(client, f"{index.prefix}:blk:{h(5).hex()}") == set()
    assert index.publish("w1", new, [h(0)], []) is True
    assert index.lookup([h(0)]) == {"w1": 1, "w2": 1}


def test_lookup_purges_stale_entries_lazily(index: PrefixIndex, client: redis.Redis) -> None:
    epoch = start_worker(index, "w1", [h(1)])
    key = f"{index.prefix}:blk:{h(0).hex()}"
    client.hset(key, "w1", str(epoch - 1))  # left behind by an older incarnation
    client.hset(key, "ghost", "3")  # a worker that has no epoch at all
    assert index.lookup([h(0), h(1)]) == {}
    assert fields_of(client, key) == set()


def test_lookup_survives_script_flush(index: PrefixIndex, client: redis.Redis) -> None:
    start_worker(index, "w1", [h(0), h(1)])
    assert index.lookup([h(0), h(1)]) == {"w1": 2}
    client.script_flush()
    assert index.lookup([h(0), h(1)]) == {"w1": 2}
    client.script_flush()
    assert index.publish("w1", index.register_worker("w1"), [h(0)], [])
    assert index.lookup([h(0), h(1)]) == {"w1": 1}


def test_lookup_of_64_hashes_is_one_round_trip(index: PrefixIndex, client: redis.Redis,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    hashes = [h(i) for i in range(64)]
    start_worker(index, "w1", hashes)
    start_worker(index, "w2", hashes[:10])
    assert index.lookup(hashes) == {"w1": 64, "w2": 10}  # loads the script
    commands: list[Any] = []
    real = client.execute_command

    def counting(*args: Any, **kwargs: Any) -> Any:
        commands.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(client, "execute_command", counting)
    assert index.lookup(hashes) == {"w1": 64, "w2": 10}
    assert commands == ["EVALSHA"]


def test_unregister_removes_blocks_and_heartbeat(index: PrefixIndex, client: redis.Redis) -> None:
    epoch = start_worker(index, "w1", [h(0), h(1)])
    start_worker(index, "w2", [h(0)])
    assert index.unregister_worker("w1", epoch)
    assert index.lookup([h(0), h(1)]) == {"w2": 1}
    assert fields_of(client, f"{index.prefix}:blk:{h(0).hex()}") == {"w2"}
    assert not client.exists(f"{index.prefix}:blk:{h(1).hex()}")
    assert [w.name for w in index.workers()] == ["w2"]
    assert index.publish("w1", epoch, [h(3)], []) is False  # a late write after shutdown
    assert index.unregister_worker("w1", epoch) is False


# ---- heartbeats, counters ----

def test_workers_round_trip_heartbeat_fields(index: PrefixIndex) -> None:
    before = time.time()
    e2 = index.register_worker("decode-1")
    e1 = index.register_worker("prefill-0")
    index.heartbeat("prefill-0", e1, "prefill", "10.0.0.1:50051", WorkerLoad(pending_prefill_tokens=1200, running=3))
    index.heartbeat("decode-1", e2, "decode", "10.0.0.2:50052", WorkerLoad(free_blocks=17))
    workers = index.workers()
    assert [w.name for w in workers] == ["decode-1", "prefill-0"]
    decode, prefill = workers
    assert (prefill.role, prefill.epoch, prefill.address) == ("prefill", e1, "10.0.0.1:50051")
    assert prefill.load == WorkerLoad(pending_prefill_tokens=1200, running=3)
    assert decode.load == WorkerLoad(free_blocks=17) and decode.role == "decode"
    assert before <= prefill.updated <= time.time()


def test_heartbeat_load_fields_stay_apart_and_unknown_ones_are_ignored(index: PrefixIndex) -> None:
    assert index.heartbeat("w1", index.register_worker("w1"), "prefill", "a:1", WorkerLoad(running=2))
    assert {"role", "epoch", "address", "updated"}.isdisjoint(WorkerLoad().as_fields())
    index.client.hset(f"{index.prefix}:hb:w1", "a_field_of_a_newer_worker", 7)  # a neighbouring version wrote it
    (w1,) = index.workers()
    assert (w1.role, w1.epoch, w1.load) == ("prefill", 1, WorkerLoad(running=2))


@pytest.mark.parametrize("how", ["ttl_s", "module constant"])
def test_expired_heartbeat_disappears(index: PrefixIndex, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    epoch = index.register_worker("w1")
    assert index.publish("w1", epoch, [h(0)], [])
    if how == "ttl_s":
        index.heartbeat("w1", epoch, "prefill", "a:1", WorkerLoad(), ttl_s=0.2)
    else:
        monkeypatch.setattr(prefix_index, "HEARTBEAT_TTL_S", 0.2)
        index.heartbeat("w1", epoch, "prefill", "a:1", WorkerLoad())
    assert [w.name for w in index.workers()] == ["w1"]
    assert index.lookup([h(0)]) == {"w1": 1}
    time.sleep(0.4)
    assert index.workers() == []
    assert index.lookup([h(0)]) == {}


def test_hit_counts_add_up(index: PrefixIndex) -> None:
    assert index.hit_counts().hit_rate == 0.0
    index.count_hits("w1", 100, 60)
    index.count_hits("w2", 50, 0)
    index.count_hits("w1", 50, 40)
    counts = index.hit_counts()
    assert (counts.requested_tokens, counts.cached_tokens) == (200, 100)
    assert counts.per_worker == {"w1": (150, 100), "w2": (50, 0)}
    assert counts.hit_rate == pytest.approx(0.5)


def test_ping_is_false_when_redis_is_unreachable(index: PrefixIndex) -> None:
    assert index.ping()
    with EmbeddedRedis() as server:
        port = server.port
    assert PrefixIndex(connect(f"redis://127.0.0.1:{port}/0")).ping() is False
