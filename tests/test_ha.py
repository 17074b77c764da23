"""High availability, from outside a real `pdcluster serve`: crashes during a Redis outage, routers that die.

One `serve` of the embedded default (private Ray, embedded Redis) for the Redis outage: its redis-server is SIGKILLed,
then the decode actor's process while Redis is still down (the supervisor waits `PDC_FAULT_REDIS_RESTART_DELAY_S`
before restarting it), and a request a minute later must be served by the restarted worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import psutil
import pytest

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
        first = stub.Generate(pb.GenerateRequest(prompt="Redis is", sampling=pb.SamplingParams(max_tokens=4)),
                              timeout=120)
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
