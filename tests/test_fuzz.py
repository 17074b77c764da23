"""Fuzzing the router's gRPC API: thousands of random and malformed requests, one answer each, nothing breaks.

Hypothesis sends random bytes and random field values (NaN temperatures, huge token ids, invalid UTF-8, unknown
fields, absurd limits) to every RPC of a real cluster (tiny model). Each call must end in OK,
INVALID_ARGUMENT or RESOURCE_EXHAUSTED; afterwards every worker is alive and idle and a valid request succeeds.
"""

from __future__ import annotations

from collections import Counter

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.v1 import inference_pb2 as pb
from tests.helpers import start_test_cluster

pytestmark = pytest.mark.slow
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
SEEN: Counter[str] = Counter()
N_RAW, N_FIELDS = 1000, 1200


@pytest.fixture(scope="module")
def fuzzed(ray_session):
    def edit(config):
        config.model = "tiny"
        config.router.max_inflight = 8
        for pool in (config.prefill, config.decode):
            pool.num_cpus, pool.num_kv_blocks = 0.5, 512

    c, server = start_test_cluster("deploy/local.yaml", "test-fuzz", edit=edit, port=0)
    channel = grpc.insecure_channel(server.address)
    yield c, server, channel
    server.close()
    c.stop()


def call(channel: grpc.Channel, method: str, data: bytes) -> grpc.StatusCode:
    """Send raw bytes to an RPC; the status it ends with (a stream is read to the end)."""
    path = f"/pdcluster.v1.Inference/{method}"
    try:
        if method.endswith("Stream"):
            for _ in channel.unary_stream(path)(data, timeout=60):
                pass
        else:
            channel.unary_unary(path)(data, timeout=60)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
    SEEN[code.name] += 1
    return code


METHODS = st.sampled_from(["Generate", "GenerateStream", "Chat", "ChatStream", "GetClusterStatus"])
# NOTE: small limits keep valid requests quick; the values around them are what tests the checks.
SAMPLING = st.builds(
    pb.SamplingParams, max_tokens=st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1)),
    temperature=st.floats(width=32), top_p=st.floats(width=32), top_k=st.integers(0, 2**32 - 1),
    seed=st.integers(0, 2**64 - 1), stop=st.lists(st.text(max_size=300), max_size=20), ignore_eos=st.booleans(),
    stop_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=3))
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)
GENERATE = st.builds(pb.GenerateRequest, request_id=st.one_of(st.just(""), TEXT), prompt=TEXT,
                     prompt_token_ids=st.lists(st.integers(0, 2**32 - 1), max_size=20), sampling=SAMPLING)
CHAT = st.builds(pb.ChatRequest, messages=st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(
    ["user", "system", "assistant", "tool", "", "wizard"]), content=TEXT), max_size=4), sampling=SAMPLING)


@settings(max_examples=N_RAW, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(method=METHODS, data=st.one_of(
    st.binary(max_size=200),
    st.builds(lambda m, tail: m.SerializeToString() + tail, GENERATE, st.binary(max_size=8)),
    st.builds(lambda t: pb.GenerateRequest(prompt="ok").SerializeToString()[:-2] + t, st.binary(min_size=1,
                                                                                               max_size=4))))
def test_random_bytes(fuzzed, method, data):
    assert call(fuzzed[2], method, data) in ALLOWED


@settings(max_examples=N_FIELDS, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(req=st.one_of(GENERATE, CHAT), stream=st.booleans())
def test_random_fields(fuzzed, req, stream):
    method = ("Generate" if isinstance(req, pb.GenerateRequest) else "Chat") + ("Stream" if stream else "")
    assert call(fuzzed[2], method, req.SerializeToString()) in ALLOWED


def test_invalid_utf8_is_invalid_argument(fuzzed):
    bad = pb.GenerateRequest(prompt="hi").SerializeToString().replace(b"hi", b"\xff\xfe")
    with pytest.raises(grpc.RpcError) as e:
        fuzzed[2].unary_unary("/pdcluster.v1.Inference/Generate")(bad, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in e.value.details()


def test_after_the_fuzzing_every_worker_is_alive_idle_and_serving(fuzzed):
    c, server, _ = fuzzed
    assert sum(SEEN.values()) >= N_RAW + N_FIELDS  # the two fuzz tests above ran first (module order)
    assert SEEN["INVALID_ARGUMENT"] > 0 and SEEN["OK"] > 0
    stub = server.stub()
    r = stub.Generate(pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)),
                      timeout=60)
    assert r.usage.completion_tokens == 3
    import time

    def idle(status: pb.ClusterStatus) -> bool:
        return all(w.alive and w.running == 0 and w.free_blocks == w.num_blocks for w in status.workers)

    deadline = time.monotonic() + 20
    status = stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30)
    while not idle(status) and time.monotonic() < deadline:
        time.sleep(0.2)
        status = stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=30)
    assert idle(status), status
