"""The cluster end to end: real Ray actors, real Redis, real SmolLM2, real gRPC over sockets.

One 2-prefill + 1-decode cluster (deploy/local-2p1d.yaml) serves the module; a colocated one is started for its
own test. The reference for every output is one in-process engine doing both phases on the same weights.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engine import SamplingParams
from engine.block_hash import hash_prompt_blocks
from router.core import Router
from router.settings import RouterSettings
from router.v1 import inference_pb2 as pb
from tests.helpers import RouterServer, make_engine, run_to_completion, start_test_cluster

pytestmark = pytest.mark.slow

PARAGRAPH = ("The history of the bicycle begins in the early nineteenth century, when inventors across Europe tried "
             "to build a practical human-powered vehicle. Early designs had no pedals; riders pushed along the "
             "ground with their feet. ")
TRAINS = ("The first public railway to use steam locomotives opened in 1825 in the north of England, carrying coal "
          "and passengers between two towns; within decades, railways had changed how people travelled and worked. ")
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    PARAGRAPH + "Summarize the paragraph above in one sentence.",
    PARAGRAPH * 3 + "What did early bicycles lack?",
    PARAGRAPH * 6 + "Name the century mentioned.",
    "Once upon a time, in a small village by the mountains, there lived",
    "Translate to French: The weather is nice today.",
    "Q: What is 12 times 12?\nA:",
    "import numpy as np\n\ndef softmax(x):",
    PARAGRAPH * 2 + "Continue the story:",
    "The three laws of motion are",
    "My favourite recipe for pancakes starts with",
]


def greedy(max_tokens: int = 16) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0)


@pytest.fixture(scope="module")
def cluster(ray_session):
    # NOTE: the SLO placement rule off (slo_itl_ms None): these tests check each request's route (its decode worker,
    # the handoff), and on busy cores the rule may keep a request whole on an idle prefill worker
    c, server = start_test_cluster("deploy/local-2p1d.yaml", "test-2p1d", slo_itl_ms=None)
    yield c, server
    server.close()
    c.stop()


@pytest.fixture(scope="module")
def reference(smollm2):
    """Greedy output (token ids, text) of one colocated engine for a prompt (text or ids)."""
    engine = make_engine(smollm2, num_blocks=2048)
    cache: dict[tuple, tuple[list[int], str]] = {}

    def run(prompt: str | list[int], max_tokens: int = 16) -> tuple[list[int], str]:
        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens)
        if key not in cache:
            engine.add_request(f"ref{len(cache)}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
            out = run_to_completion(engine)[f"ref{len(cache)}"]
            cache[key] = (out.token_ids, out.text)
        return cache[key]
    return run


def call(stub, req: pb.GenerateRequest, stream: bool) -> tuple[list[int], str, pb.GenerateChunk | pb.GenerateResponse]:
    if not stream:
        r = stub.Generate(req, timeout=300)
        return list(r.token_ids), r.text, r
    ids, text, last = [], "", None
    for chunk in stub.GenerateStream(req, timeout=300):
        ids += chunk.token_ids
        text += chunk.text
        last = chunk
        assert bool(chunk.finish_reason) == chunk.HasField("usage")  # usage/timeline on the last chunk only
    return ids, text, last


def test_pools_are_sized_from_yaml_as_named_actors(cluster, ray_session):
    c, _ = cluster
    assert sorted(c.actors) == ["decode-0", "prefill-0", "prefill-1"]
    for name in c.actors:
        assert ray_session.get_actor(name, namespace="test-2p1d") is not None
    with pytest.raises(ValueError):
        ray_session.get_actor("prefill-2", namespace="test-2p1d")
    assert {i.role for i in c.infos.values()} == {"prefill", "decode"}


def test_sixteen_concurrent_requests_match_the_colocated_engine(cluster, reference, smollm2):
    _, server = cluster
    stub = server.stub()
    prompts: list[str | list[int]] = [*PROMPTS, smollm2.tokenizer.encode("The moon is"),
                                      smollm2.tokenizer.encode(PARAGRAPH * 2 + "Why?")]
    assert len(prompts) == 16
    want = [reference(p) for p in prompts]

    def one(i: int):
        p = prompts[i]
        req = pb.GenerateRequest(request_id=f"c16-{i}", sampling=greedy())
        if isinstance(p, str):
            req.prompt = p
        else:
            req.prompt_token_ids.extend(p)
        return call(stub, req, stream=i % 2 == 1)

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    prefill_workers = set()
    for i, ((ids, text, last), (want_ids, want_text)) in enumerate(zip(results, want)):
        assert ids == want_ids, f"prompt {i}"
        assert text == want_text, f"prompt {i}"
        assert last.request_id == f"c16-{i}"
        assert last.usage.completion_tokens == len(ids) and last.finish_reason in ("stop", "length")
        tl = last.timeline
        assert tl.decode_worker == "decode-0" and tl.first_token_ms <= tl.total_ms
        if not tl.prefill_skipped:
            prefill_workers.add(tl.prefill_worker)
            assert tl.prefill_ms > 0
            # NOTE: a request that ended at its first token hands nothing off: its layers, held until the decode
            # worker answered the handshake, need not move (prefill_workers/held_layers.py)
            assert tl.kv_bytes_sent > 0 or last.usage.completion_tokens == 1
    assert prefill_workers == {"prefill-0", "prefill-1"}  # both prefill workers got traffic


def test_seeded_sampling_draws_the_same_tokens_as_one_engine(cluster, smollm2):
    """The first token is sampled on a prefill worker, the rest on the decode worker: the same draws as one engine."""
    _, server = cluster
    prompt = ("Lighthouses guided ships along dangerous coasts for centuries. Keepers trimmed the wicks, polished "
              "the lenses and logged every passing vessel through long winter nights. Write the next sentence:")
    engine = make_engine(smollm2, num_blocks=512)
    engine.add_request("seeded", prompt, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, top_k=50,
                                                         seed=1234, ignore_eos=True))
    want = run_to_completion(engine)["seeded"].token_ids
    req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9,
                                                                      top_k=50, seed=1234, ignore_eos=True))
    ids, _, last = call(server.stub(), req, stream=True)
    assert ids == want and not last.timeline.prefill_skipped


def test_chat_applies_the_template_and_matches_the_engine(cluster, reference, smollm2):
    _, server = cluster
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]
    want = reference(smollm2.tokenizer.apply_chat_template(messages), 24)
    req = pb.ChatRequest(messages=[pb.ChatMessage(**m) for m in messages], sampling=greedy(24))
    r = server.stub().Chat(req, timeout=120)
    assert (list(r.token_ids), r.text) == want
    chunks = list(server.stub().ChatStream(req, timeout=120))
    assert "".join(c.text for c in chunks) == want[1]


def test_a_shared_prefix_is_routed_to_its_holder_and_counted(cluster, reference):
    c, server = cluster
    stub = server.stub()
    index = c.index()
    before = index.hit_counts()
    prefix = TRAINS * 6  # ~360 tokens that no other test sends
    a = call(stub, pb.GenerateRequest(prompt=prefix + "Question one: who rode first?", sampling=greedy(8)), False)[2]
    holder = a.timeline.prefill_worker
    assert holder and a.usage.cached_prompt_tokens == 0
    info = c.infos[holder]
    ids = reference(prefix + "Question one: who rode first?", 8)  # same tokens as the cluster (checked above too)
    assert list(a.token_ids) == ids[0]
    # the prefix blocks are in Redis for the prefill worker that computed them
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_json(info.tokenizer_json)
    prompt_b = prefix + " A different question follows, long enough to need the prefill pool: " + PARAGRAPH * 2
    hashes = hash_prompt_blocks(tok.encode(prefix), info.block_size, info.scope)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and index.lookup(hashes).get(holder, 0) < len(hashes):
        time.sleep(0.05)
    assert index.lookup(hashes)[holder] == len(hashes)
    b = call(stub, pb.GenerateRequest(prompt=prompt_b, sampling=greedy(8)), True)[2]
    assert b.timeline.prefill_worker == holder  # routed to the worker holding the prefix
    assert b.usage.cached_prompt_tokens >= (len(hashes) - 1) * info.block_size
    assert b.timeline.kv_blocks_sent < -(-b.usage.prompt_tokens // 16)  # decode already held the prefix too
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and index.hit_counts().cached_tokens == before.cached_tokens:
        time.sleep(0.05)
    after = index.hit_counts()
    assert after.cached_tokens - before.cached_tokens >= b.usage.cached_prompt_tokens
    assert after.requested_tokens - before.requested_tokens >= a.usage.prompt_tokens + b.usage.prompt_tokens
    # the same prompt again: the decode worker holds all but the last partial block, prefill is skipped
    again = call(stub, pb.GenerateRequest(prompt=prompt_b, sampling=greedy(8)), False)[2]
    assert again.timeline.prefill_skipped and again.usage.cached_prompt_tokens > 0
    assert list(again.token_ids) == list(call(stub, pb.GenerateRequest(prompt=prompt_b, sampling=greedy(8)),
                                              True)[0]) == reference(prompt_b, 8)[0]


BAD_REQUESTS = [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(prompt="hello " * 9000), "prompt"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=0)), "sampling.max_tokens"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=-0.5)), "sampling.temperature"),
    (pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(top_p=2)), "sampling.top_p"),
    (pb.GenerateRequest(prompt_token_ids=[49152]), "prompt_token_ids"),
    (pb.ChatRequest(messages=[pb.ChatMessage(role="robot", content="x")]), "messages[0].role"),
]


@pytest.mark.parametrize("req,field", BAD_REQUESTS, ids=[f for _, f in BAD_REQUESTS])
def test_bad_requests_get_invalid_argument_and_others_keep_flowing(cluster, req, field):
    _, server = cluster
    stub = server.stub()
    calls = [stub.Chat, stub.ChatStream] if isinstance(req, pb.ChatRequest) else [stub.Generate, stub.GenerateStream]
    for rpc in calls:
        with pytest.raises(grpc.RpcError) as e:
            result = rpc(req, timeout=60)
            list(result) if not isinstance(result, pb.GenerateResponse) else None
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in e.value.details()
    assert stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=greedy(2)), timeout=60).usage.completion_tokens == 2


def test_unknown_fields_on_the_wire_are_invalid_argument(cluster):
    _, server = cluster
    channel = grpc.insecure_channel(server.address)
    raw = channel.unary_unary("/pdcluster.v1.Inference/Generate")
    data = pb.GenerateRequest(prompt="hi").SerializeToString() + b"\xa8\x06\x05"
    with pytest.raises(grpc.RpcError) as e:
        raw(data, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown field number 101" in e.value.details()


def test_a_second_router_shares_the_redis_state_and_sheds_overload(cluster):
    c, server = cluster
    second = Router(c.handles(), c.index(), RouterSettings(model="smollm2", mode="disaggregated", max_inflight=1))
    other = RouterServer(second)
    try:
        stub = other.stub()
        prompt = PARAGRAPH * 5 + "Second router, first question."
        first = stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=greedy(4)), timeout=120)
        # the first router sees, through Redis, where the second one put the prefix: the repeat skips prefill
        again = server.stub().Generate(pb.GenerateRequest(prompt=prompt, sampling=greedy(4)), timeout=120)
        assert again.timeline.prefill_skipped and again.usage.cached_prompt_tokens > 0
        assert list(again.token_ids) == list(first.token_ids)
        # max_inflight=1: a second concurrent request is shed with RESOURCE_EXHAUSTED, the first completes
        long_stream = stub.GenerateStream(pb.GenerateRequest(prompt="Tell me a story.", sampling=pb.SamplingParams(
            max_tokens=64, temperature=0, ignore_eos=True)), timeout=120)
        first_chunk = next(long_stream)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=greedy(2)), timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_inflight" in e.value.details()
        rest = list(long_stream)
        assert len(first_chunk.token_ids) + sum(len(x.token_ids) for x in rest) == rest[-1].usage.completion_tokens
    finally:
        other.close()


def test_status_health_and_reflection(cluster):
    _, server = cluster
    st = server.stub().GetClusterStatus(pb.ClusterStatusRequest(), timeout=30)
    assert st.model == "smollm2" and st.mode == "disaggregated" and st.redis_ok
    assert [(w.name, w.role, w.alive) for w in st.workers] == [
        ("prefill-0", "prefill", True), ("prefill-1", "prefill", True), ("decode-0", "decode", True)]
    assert all(w.num_blocks == 2048 and w.epoch >= 1 for w in st.workers)
    assert st.requested_prompt_tokens >= st.cached_prompt_tokens > 0
    channel = grpc.insecure_channel(server.address)
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="pdcluster.v1.Inference"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    services = {s.name for r in replies for s in r.list_services_response.service}
    assert {"pdcluster.v1.Inference", "grpc.health.v1.Health"} <= services


def test_bench_runner_times_every_token_of_a_multi_turn_workload(cluster):
    import asyncio

    from pdcluster.bench import stats
    from pdcluster.bench.runner import run_workload
    from pdcluster.bench.workloads import build

    _, server = cluster
    # NOTE: the users think a tenth as long (2 s a turn on average): the turns' order is what is checked, not waits
    w = build("shared_prompt", 4.0, 8, seed=5, input_scale=0.1, output_scale=0.2, think_scale=0.1)
    records, elapsed = asyncio.run(run_workload(server.address, w))
    assert len(records) == 8 and all(r.ok for r in records), [r.error for r in records]
    for r in records:
        assert r.output_len == r.max_tokens and len(r.itl_ms) == r.output_len - 1
        assert 0 < r.ttft_ms <= r.e2e_ms and r.decode_worker
    by_session: dict[int, list] = {}
    for r in records:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn)
        for a, b in zip(turns, turns[1:]):
            assert b.sent_s >= a.sent_s + a.e2e_ms / 1e3  # a turn goes out only after the previous answer
            assert b.prompt_len > a.prompt_len + a.output_len
            assert b.cached_tokens > 0  # the conversation so far is served from a prefix cache
    s = stats.summarize(records, elapsed, stats.Slo(60_000, 60_000))
    assert s["completed"] == 8 and s["slo_attainment"] == 1.0 and s["prefix_hit_rate"] > 0.3


def test_bench_serve_command_writes_json_and_plots(cluster, tmp_path):
    import json

    from pdcluster.cli import main

    _, server = cluster
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--addr", server.address, "--workload", "mixed", "--rates", "2,4",
                 "--num-requests", "3", "--input-scale", "0.05", "--output-scale", "0.1", "--warmup-requests", "1",
                 "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert [r["workload"]["rate"] for r in figures["runs"]] == [2.0, 4.0]
    assert all(r["summary"]["completed"] == 3 for r in figures["runs"])
    assert figures["goodput"][server.address]["goodput_req_per_s"] == 4.0
    for png in figures["plots"]:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_kv_blocks_return_to_baseline_after_the_traffic(cluster):
    c, _ = cluster
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        loads = [ray_get(a.load.remote()) for a in c.actors.values()]
        if all(x.free_blocks == x.num_blocks and x.running == x.reserved == 0 for x in loads):
            break
        time.sleep(0.1)
    assert all(x.free_blocks == x.num_blocks and x.running == x.reserved == 0 for x in loads), loads


def ray_get(ref):
    import ray

    return ray.get(ref, timeout=30)


def test_colocated_mode_matches_the_engine(ray_session, reference):
    c, server = start_test_cluster("deploy/local-colocated.yaml", "test-colocated")
    try:
        assert sorted(c.actors) == ["colocated-0", "colocated-1"]
        stub = server.stub()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: call(stub, pb.GenerateRequest(prompt=PROMPTS[i], sampling=greedy()),
                                                    i % 2 == 0), range(4)))
        for i, (ids, text, last) in enumerate(results):
            assert (ids, text) == reference(PROMPTS[i])
            assert last.timeline.prefill_skipped and last.timeline.decode_worker.startswith("colocated-")
        assert {r[2].timeline.decode_worker for r in results} == {"colocated-0", "colocated-1"}
    finally:
        server.close()
        c.stop()
