"""High availability, from outside a real `pdcluster serve`: crashes during a Redis outage, routers that die.

1. One `serve` of the embedded default (private Ray, embedded Redis) for the Redis outage: its redis-server is
   SIGKILLed, then the decode actor's process while Redis is still down (the supervisor waits
   `PDC_FAULT_REDIS_RESTART_DELAY_S` before restarting it), and a request a minute later must be served.
2. Meanwhile (NOTE: the minute is spent on the next test, so the module costs one minute, not two) a `serve` on a
   Ray and a Redis of its own (`ray start --head`, an external Redis) is killed with `kill -9` with 8 streams in
   flight: the workers live on, their leases run out and every block comes back; a restarted `serve` re-attaches
   to the same workers (a prefix-cache hit) and `--keep-workers` leaves them running when it stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import psutil
import pytest

from cluster.prefix_index import PrefixIndex
from pdcluster.redis_server import EmbeddedRedis, connect
from router.v1 import inference_pb2 as pb
from router.v1 import inference_pb2_grpc as pb_grpc
from tests.test_serve import start_serve

pytestmark = pytest.mark.slow
REDIS_OUTAGE_S = 25.0  # the embedded Redis stays down this long: longer than the decode actor's restart
SERVED_AFTER_S = 60.0  # the request that must be served comes this long after the kills


def _family(proc: subprocess.Popen[str]) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def _find(proc: subprocess.Popen[str], needle: str) -> psutil.Process:
    for p in _family(proc):
        try:
            if needle in p.name() or needle in " ".join(p.cmdline()):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no process {needle!r} under serve")


def _http(url: str) -> tuple[int, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def outage() -> Iterator[tuple[subprocess.Popen[str], dict[str, str], float]]:
    """A `serve` whose embedded Redis and then decode actor were killed (the monotonic time of the kills)."""
    os.environ["PDC_FAULT_REDIS_RESTART_DELAY_S"] = str(REDIS_OUTAGE_S)
    try:
        proc, endpoints = start_serve("--config", "deploy/local.yaml", "--port", "0", "--http-port", "0",
                                      "--metrics-port", "0")
    finally:
        del os.environ["PDC_FAULT_REDIS_RESTART_DELAY_S"]
    try:
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(endpoints["grpc"]))
        first = stub.Generate(pb.GenerateRequest(prompt="Redis is", sampling=pb.SamplingParams(
            max_tokens=4, ignore_eos=True)), timeout=120)
        assert first.usage.completion_tokens == 4
        redis = _find(proc, "redis-server")
        redis.send_signal(signal.SIGKILL)
        redis.wait(10)
        decode = _find(proc, "DecodeActor")
        killed_at = time.monotonic()
        decode.send_signal(signal.SIGKILL)  # NOTE: Ray restarts it while Redis is still down
        yield proc, endpoints, killed_at
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


HA_YAML = """
model: smollm2
ray: {{address: "{ray}", namespace: pdc-ha}}
redis: {{url: "redis://127.0.0.1:{redis_port}/0", password_env: PDC_HA_REDIS_PASSWORD, key_prefix: ha}}
router: {{port: 0, lease_s: {lease_s}}}
http: {{port: 0}}
metrics: {{port: 0, workers: false}}
security: {{cluster_token_env: PDC_HA_TOKEN}}
prefill: {{replicas: 1, num_cpus: 1, torch_threads: 1, num_kv_blocks: 512}}
decode: {{replicas: 1, num_cpus: 1, torch_threads: 1, num_kv_blocks: 512}}
"""
LEASE_S = 5.0
STREAMS = 8
WARM_PROMPT = ("A lighthouse keeper writes a long letter to her sister about the storms of the last winter, the ships "
               "that passed, the birds that stayed, and the book she finally finished reading by the lamp:")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def ray_head(tmp_path_factory) -> Iterator[str]:
    """A Ray of its own (`ray start --head`), which outlives every `serve` of the test; stopped by its pids."""
    port, temp = _free_port(), tempfile.mkdtemp(prefix="pdcha-")
    log = tmp_path_factory.mktemp("ray") / "ray.log"
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_USAGE_STATS_ENABLED="0")
    with open(log, "w") as out:
        head = subprocess.Popen(["ray", "start", "--head", "--block", "--port", str(port),
                                 "--num-cpus", "4", "--object-store-memory", str(200 << 20),
                                 "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (address := re.search(r"ray start --address='([^']+)'", log.read_text())):
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield address.group(1)  # NOTE: the node's own IP: Ray turns 127.0.0.1 into it, and binds only that
    finally:
        family = psutil.Process(head.pid).children(recursive=True)
        head.kill()
        head.wait(30)
        for p in family:  # NOTE: by pid: `ray stop` would stop every Ray of this machine
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(family, timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


def _blocks(index: PrefixIndex) -> dict[str, tuple[int, int, int]]:
    """Each worker's (epoch, free blocks, total blocks), from its heartbeat in Redis."""
    return {w.name: (w.epoch, w.load.free_blocks, w.load.num_blocks) for w in index.workers()}


def test_a_router_killed_with_8_streams_in_flight_frees_every_block_and_a_new_serve_reattaches(
        outage, ray_head, tmp_path, monkeypatch) -> None:
    # NOTE: `outage` only starts the previous module fixture first: its minute runs while this test does
    password, token = "ha-redis-" + os.urandom(6).hex(), "ha-token-" + os.urandom(6).hex()
    monkeypatch.setenv("PDC_HA_REDIS_PASSWORD", password)
    monkeypatch.setenv("PDC_HA_TOKEN", token)
    with EmbeddedRedis(password=password) as redis_server:
        config = tmp_path / "ha.yaml"
        config.write_text(HA_YAML.format(ray=ray_head, redis_port=redis_server.port, lease_s=LEASE_S))
        index = PrefixIndex(connect(redis_server.url), "ha")
        first, endpoints = start_serve("--config", str(config))
        try:
            stub = pb_grpc.InferenceStub(grpc.insecure_channel(endpoints["grpc"]))
            warm = stub.Generate(pb.GenerateRequest(prompt=WARM_PROMPT, sampling=pb.SamplingParams(
                max_tokens=4, temperature=0)), timeout=120)
            before = _blocks(index)
            assert set(before) == {"prefill-0", "decode-0"}
            started = threading.Barrier(STREAMS + 1, timeout=120)

            def stream(i: int) -> None:
                chunks = stub.GenerateStream(pb.GenerateRequest(
                    prompt=f"Stream {i}: tell a very long story about a river.",
                    sampling=pb.SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0)), timeout=300)
                try:
                    for n, _ in enumerate(chunks):
                        if n == 1:
                            started.wait()
                except grpc.RpcError:
                    pass  # NOTE: the router is killed under it

            threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(STREAMS)]
            for t in threads:
                t.start()
            started.wait()
            busy = _blocks(index)
            first.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            first.wait(30)
        finally:
            if first.poll() is None:
                first.kill()
        # the 8 streams hold blocks when the router dies: on decode-0, or on prefill-0 for a stream the router kept
        # there whole (its `stay` rule, when a loaded machine makes decode-0's measured steps exceed slo_itl_ms)
        assert sum(total - free for _, free, total in busy.values()) > 0, busy
        # the workers live on; no live router renews their requests' leases: every block comes back
        freed_after = None
        while time.monotonic() - killed_at < 30:
            now = _blocks(index)
            if now.get("decode-0", (0, 0, 1))[1:] == (before["decode-0"][2], before["decode-0"][2]) \
                    and now.get("prefill-0", (0, 0, 1))[1] == now.get("prefill-0", (0, 0, 1))[2]:
                freed_after = time.monotonic() - killed_at
                break
            time.sleep(0.1)
        assert freed_after is not None and freed_after <= 10.0, (freed_after, _blocks(index))
        print(f"every block back {freed_after:.1f} s after kill -9 (router.lease_s {LEASE_S:g})")
        assert {n: e for n, (e, _, _) in _blocks(index).items()} == {n: e for n, (e, _, _) in before.items()}
        # a new `serve` (keeping its workers when stopped) re-attaches to the same processes, prefix caches and all
        second, endpoints = start_serve("--config", str(config), "--keep-workers")
        extra = None
        try:
            stub = pb_grpc.InferenceStub(grpc.insecure_channel(endpoints["grpc"]))
            again = stub.Generate(pb.GenerateRequest(prompt=WARM_PROMPT, sampling=pb.SamplingParams(
                max_tokens=4, temperature=0)), timeout=120)
            assert list(again.token_ids) == list(warm.token_ids) and again.timeline.decode_worker == "decode-0"
            assert again.usage.cached_prompt_tokens > 0, again.usage
            st = stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30)
            assert {w.name: w.epoch for w in st.workers} == {n: e for n, (e, _, _) in before.items()}
            # an extra router, on ports of its own (the README's recipe)
            extra, extra_endpoints = start_serve("--config", str(config), "--ray", ray_head, "--redis",
                                                 f"127.0.0.1:{redis_server.port}", "--port", "0", "--http-port", "0",
                                                 "--metrics-port", "0", command="router")
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(60) == 0
        try:
            time.sleep(1.0)  # two heartbeats
            assert {n: e for n, (e, _, _) in _blocks(index).items()} == {n: e for n, (e, _, _) in before.items()}
            # a `serve` of another cluster token cannot adopt the running workers: it replaces them (same names),
            # and the extra router finds the new ones instead of answering 503 forever
            monkeypatch.setenv("PDC_HA_TOKEN", token + "-rotated")
            third, _ = start_serve("--config", str(config))
            try:
                extra_stub = pb_grpc.InferenceStub(grpc.insecure_channel(extra_endpoints["grpc"]))
                deadline, served = time.monotonic() + 60, None
                while served is None and time.monotonic() < deadline:
                    try:
                        served = extra_stub.Generate(pb.GenerateRequest(prompt="Again", sampling=pb.SamplingParams(
                            max_tokens=4, ignore_eos=True)), timeout=30)
                    except grpc.RpcError:
                        time.sleep(0.5)
                assert served is not None and served.usage.completion_tokens == 4
                assert {n: e for n, (e, _, _) in _blocks(index).items()} != {n: e for n, (e, _, _) in before.items()}
            finally:
                # without --keep-workers, a `serve` stopped by a signal stops what it runs
                third.send_signal(signal.SIGTERM)
                assert third.wait(60) == 0
            assert index.workers() == []  # unregistered: closed, not merely expired
        finally:
            if extra is not None:
                extra.send_signal(signal.SIGTERM)
                extra.wait(60)


def test_a_decode_worker_restarted_while_redis_is_down_serves_a_minute_later(outage) -> None:
    proc, endpoints, killed_at = outage
    time.sleep(max(0.0, killed_at + SERVED_AFTER_S - time.monotonic()))
    stub = pb_grpc.InferenceStub(grpc.insecure_channel(endpoints["grpc"]))
    r = stub.Generate(pb.GenerateRequest(prompt="After the outage, the cluster",
                                         sampling=pb.SamplingParams(max_tokens=8, temperature=0)), timeout=120)
    assert r.usage.completion_tokens == 8 and r.timeline.decode_worker == "decode-0"
    # the embedded Redis is back on its port with its password (the router's client reconnected by itself), and the
    # restarted worker registered with it: its heartbeat is there
    st = stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30)
    assert st.redis_ok and {w.name: w.alive for w in st.workers} == {"prefill-0": True, "decode-0": True}, st
    assert _http(f"http://{endpoints['http']}/health") == (200, {"status": "ok"})
    assert _http(f"http://{endpoints['http']}/live") == (200, {"status": "ok"})
