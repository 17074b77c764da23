"""The router's pieces without Ray: request validation, the routing policy, and the worker classes in-process."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cluster.messages import DecodeRequest, PrefillRequest, WorkerLoad
from cluster.prefix_index import PrefixIndex
from cluster.worker import WorkerSpec
from decode_workers.worker import DecodeWorker
from engine import EngineConfig, InvalidRequestError
from engine.block_hash import hash_prompt_blocks
from engine.step_budget import STARVED_STEPS_MAX
from kv_transfer.state import TransferConfig
from pdcluster.redis_server import EmbeddedRedis, connect
from prefill_workers.worker import PrefillWorker
from router.grpc_requests import ProtoValidator
from router.policy import Policy, WorkerView
from router.v1 import inference_pb2 as pb
from router.validate import RequestValidator
from tests.helpers import GREEDY, generate_ids, make_engine, random_prompts, run_to_completion

CFG = EngineConfig(num_blocks=256, num_threads=2)


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as r:
        yield r.url


@pytest.fixture(scope="module")
def workers(tiny, redis_url):
    p = PrefillWorker(WorkerSpec("prefill-0", "prefill", "tiny", CFG, TransferConfig(), redis_url, "unit"), tiny)
    d = DecodeWorker(WorkerSpec("decode-0", "decode", "tiny", CFG, TransferConfig(), redis_url, "unit"), tiny)
    yield p, d
    p.close()
    d.close()


@pytest.fixture(scope="module")
def validator(workers):
    return ProtoValidator(RequestValidator(workers[1].info()))


def sampling(**kw):
    return pb.SamplingParams(**kw)


BAD = [
    (pb.GenerateRequest(), "prompt"),
    (pb.GenerateRequest(prompt="hi", prompt_token_ids=[1, 2]), "prompt_token_ids"),
    (pb.GenerateRequest(prompt_token_ids=[10**6]), "prompt_token_ids"),
    (pb.GenerateRequest(prompt="hello world, " * 3000), "prompt"),  # longer than the context
    (pb.GenerateRequest(prompt_token_ids=[5] * 5000), "prompt_token_ids"),
    (pb.GenerateRequest(prompt="hi", sampling=sampling(max_tokens=0)), "sampling.max_tokens"),
    (pb.GenerateRequest(prompt="hi", sampling=sampling(max_tokens=10**6)), "sampling.max_tokens"),
    (pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=-1)), "sampling.temperature"),
    (pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=float("nan"))), "sampling.temperature"),
    (pb.GenerateRequest(prompt="hi", sampling=sampling(top_p=0)), "sampling.top_p"),
    (pb.GenerateRequest(prompt="hi", sampling=sampling(top_p=1.5)), "sampling.top_p"),
    (pb.GenerateRequest(prompt="hi", sampling=sampling(stop=[""])), "sampling.stop"),
    (pb.GenerateRequest(prompt="hi", sampling=sampling(stop=["a"] * 17)), "sampling.stop"),
    (pb.GenerateRequest(prompt="hi", sampling=sampling(stop_token_ids=[10**6])), "sampling.stop_token_ids"),
    (pb.GenerateRequest(request_id="x" * 300, prompt="hi"), "request_id"),
    (pb.GenerateRequest(request_id="a\nb", prompt="hi"), "request_id"),
    (pb.ChatRequest(), "messages"),
    (pb.ChatRequest(messages=[pb.ChatMessage(role="wizard", content="hi")]), "messages[0].role"),
]


@pytest.mark.parametrize("req,field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_bad_requests_are_rejected_naming_the_field(validator, req, field):
    check = validator.chat if isinstance(req, pb.ChatRequest) else validator.generate
    with pytest.raises(InvalidRequestError) as e:
        check(req)
    assert e.value.field == field and field in str(e.value)


@pytest.mark.parametrize("where", ["top", "sampling", "message"])
def test_unknown_fields_are_rejected_not_dropped(validator, where):
    extra = b"\xa8\x06\x05"  # field 101, varint 5: not in the schema
    if where == "message":
        msg = pb.ChatMessage(role="user", content="hi").SerializeToString() + extra
        req = pb.ChatRequest.FromString(pb.ChatRequest(messages=[pb.ChatMessage.FromString(msg)]).SerializeToString())
        with pytest.raises(InvalidRequestError, match=r"messages\[0\]"):
            validator.chat(req)
        return
    if where == "top":
        data = pb.GenerateRequest(prompt="hi").SerializeToString() + extra
    else:
        data = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams.FromString(
            pb.SamplingParams(max_tokens=2).SerializeToString() + extra)).SerializeToString()
    with pytest.raises(InvalidRequestError, match="unknown field number 101") as e:
        validator.generate(pb.GenerateRequest.FromString(data))
    assert e.value.field == ("sampling" if where == "sampling" else "GenerateRequest")


def test_defaults_follow_vllm_and_openai(validator):
    checked = validator.generate(pb.GenerateRequest(prompt="hi"))
    p = checked.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k) == (16, 1.0, 1.0, 0)
    assert checked.request_id.startswith("req-") and p.seed is not None
    explicit = validator.generate(pb.GenerateRequest(prompt="hi", sampling=sampling(temperature=0, seed=7)))
    assert explicit.params.greedy and explicit.params.seed == 7


def test_chat_applies_the_models_template(validator, tiny):
    req = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="hello there")])
    text = tiny.tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}])
    assert validator.chat(req).token_ids == tiny.tokenizer.encode(text)


def view(name, **load):
    return WorkerView(name, num_blocks=1000, max_num_seqs=8, load=WorkerLoad(**{"free_blocks": 1000, **load}))


def test_prefill_choice_follows_predicted_ttft():
    pol = Policy("prefix_aware", 16, 64)
    prefill = [view("p0", pending_prefill_tokens=4000), view("p1")]
    # p0 caches 30 of 32 blocks but has 4,000 tokens queued: p1 computing all 512 tokens is sooner
    assert pol.route(512, 8, {"p0": 30}, prefill, [view("d0")]).prefill == "p1"
    prefill[0].load = dataclasses.replace(prefill[0].load, pending_prefill_tokens=0)
    assert pol.route(512, 8, {"p0": 30}, prefill, [view("d0")]).prefill == "p0"


def test_decode_choice_weighs_load_free_blocks_and_prefix():
    pol = Policy("prefix_aware", 16, 0)
    d = [view("d0", running=6), view("d1", running=1)]
    assert pol.route(100, 10, {}, [view("p")], d).decode == "d1"
    d[1].load = dataclasses.replace(d[1].load, free_blocks=3)  # cannot hold 110 tokens
    assert pol.route(100, 10, {}, [view("p")], d).decode == "d0"
    even = [view("d0", running=2), view("d1", running=2)]
    assert pol.route(320, 10, {"d1": 20}, [view("p")], even).decode == "d1"


def test_prefill_is_skipped_only_when_the_decode_worker_caches_nearly_all():
    pol = Policy("prefix_aware", 16, 64)
    assert pol.route(40, 8, {}, [view("p")], [view("d")]).prefill == "p"  # short but uncached: prefill pool
    assert pol.route(1000, 8, {"d": 60}, [view("p")], [view("d")]).prefill is None  # 40 tokens left
    assert pol.route(1000, 8, {"d": 50}, [view("p")], [view("d")]).prefill == "p"  # 200 tokens left
    assert Policy("round_robin", 16, 64).route(1000, 8, {"d": 60}, [view("p")], [view("d")]).prefill == "p"


# measured step costs as heartbeats carry them: 20 ms a step + 1 ms a token, 256 tokens a step at most
STEPS = {"step_base_us": 20_000, "step_token_ns": 1_000_000, "max_num_batched_tokens": 256}


@pytest.mark.parametrize("prefill_load,decode_load,prompt_len,matched,where", [
    ({}, {}, 40, 0, "p"),  # both idle: the prefill pool (the decode batch is never lengthened for nothing)
    ({"pending_prefill_tokens": 6000}, {}, 40, 0, None),  # prefill busy with long documents: the decode worker
    ({"pending_prefill_tokens": 6000}, {"running": 8}, 40, 0, None),  # a decode step of 8 + 40 tokens: 68 ms ≤ 100
    ({"pending_prefill_tokens": 6000}, {}, 120, 0, None),  # nothing decodes: its chunks take whole steps
    ({"pending_prefill_tokens": 6000}, {"running": 60}, 40, 0, None),  # two 20-token chunks beside 60 decodes
    ({"pending_prefill_tokens": 6000}, {"running": 80}, 40, 0, "p"),  # decode alone fills its 100 ms steps
    ({"pending_prefill_tokens": 6000}, {"pending_prefill_tokens": 70}, 40, 0, None),  # behind 70 queued there
    ({"pending_prefill_tokens": 1000}, {"running": 60}, 300, 0, "p"),  # 15 chunks of 20 (1.6 s) > the queue (1.1 s)
    ({"pending_prefill_tokens": 6000}, {"running": 8}, 400, 22, None),  # the 48 tokens the decode worker lacks
    ({"pending_prefill_tokens": 6000, "shortest_first": 1}, {}, 40, 0, None),  # waits for one full 256-token step
    ({"pending_prefill_tokens": 30, "shortest_first": 1}, {"running": 8}, 40, 0, "p"),  # a short queue: no gain
])
def test_a_prompt_goes_where_its_first_token_is_sooner_in_chunks_within_the_itl_slo(
        prefill_load, decode_load, prompt_len, matched, where):
    pol = Policy("prefix_aware", 16, 0, slo_itl_ms=100)
    route = pol.route(prompt_len, 8, {"d": matched}, [view("p", **STEPS, **prefill_load)],
                      [view("d", **STEPS, **decode_load)])
    assert route.prefill == where
    assert route.why == ("" if where else "slo")
    assert route.decode_prefill_tokens == (0 if where else prompt_len - 16 * matched)
    off = Policy("prefix_aware", 16, 0, slo_itl_ms=None)  # the SLO rule off: always the prefill pool
    assert off.route(prompt_len, 8, {}, [view("p", **STEPS, **prefill_load)], [view("d", **STEPS)]).prefill == "p"


def test_the_decode_paths_prediction_counts_its_chunks_and_what_is_queued_there():
    pol = Policy("prefix_aware", 16, 0, slo_itl_ms=100)
    # 60 decoding: 20 prompt tokens a step; 30 queued + 70 new = 5 steps of 80 tokens, after the step in flight
    d = view("d", **STEPS, running=60, pending_prefill_tokens=30)
    assert pol.itl_budget(d) == 20
    assert pol.decode_ttft_s(d, 70) == pytest.approx(0.020 + 0.080 + 5 * 0.020 + (5 * 60 + 100) * 0.001)
    full = view("d", **STEPS, running=80)  # no budget: STARVED_STEPS_MAX steps without, then one block a step
    assert pol.chunk_tokens(full) == 16
    steps = STARVED_STEPS_MAX + 3  # 40 tokens: 3 blocks
    assert pol.decode_ttft_s(full, 40) == pytest.approx(0.1 + steps * 0.020 + (steps * 80 + 40) * 0.001)


@pytest.mark.parametrize("prefill_load,decode_load,matched,where", [
    ({}, {"running": 100}, 0, "p"),  # decode alone takes 120 ms a step: the request stays where it is prefilled
    ({"pending_prefill_tokens": 2000}, {"running": 100}, 0, "d"),  # prompts queued there: not slowed for it
    ({"running": 5}, {"running": 100}, 0, "d"),  # 5 decoding there: its prompt in 75-token chunks, a later TTFT
    ({}, {"running": 60}, 0, "d"),  # decode steps within the target: the usual handoff
    ({"running": 8}, {"running": 100}, 0, "d"),  # the prefill worker's batch is full (max_num_seqs 8)
    ({"free_blocks": 10}, {"running": 100}, 0, "d"),  # no room for its KV there
    ({}, {"running": 100}, 20, "p"),  # cached there: only the rest is computed
])
def test_when_decode_is_the_bottleneck_a_request_stays_on_the_prefill_worker(prefill_load, decode_load, matched,
                                                                             where):
    pol = Policy("prefix_aware", 16, 0, slo_itl_ms=100)
    route = pol.route(400, 8, {"p": matched}, [view("p", **STEPS, **prefill_load)],
                      [view("d", **STEPS, **decode_load)])
    if where == "p":
        assert (route.prefill, route.decode, route.why) == (None, "p", "stay")
        assert route.decode_prefill_tokens == 400 - 16 * matched
    else:
        assert (route.prefill, route.decode, route.why) == ("p", "d", "")
    off = Policy("prefix_aware", 16, 0, slo_itl_ms=None)  # no ITL target: never
    assert off.route(400, 8, {}, [view("p", **STEPS, **prefill_load)], [view("d", **STEPS, **decode_load)]).why == ""


def test_predictions_use_measured_steps_priors_before_and_the_kv_transfer():
    pol = Policy("prefix_aware", 16, 64)  # NOTE: the SLO rule off, so the prefill pool's prediction is reported
    measured = pol.route(100, 8, {}, [view("p", **STEPS, pending_prefill_tokens=412)], [view("d")])
    # fcfs: 512 tokens in 2 steps = 2 × 20 ms + 512 ms, then the transfer's prior (5 ms + 100 × 50 µs)
    assert measured.predicted_ttft_ms == pytest.approx(40 + 512 + 10)
    unmeasured = pol.route(100, 8, {}, [view("p", pending_prefill_tokens=412)], [view("d")])
    assert unmeasured.predicted_ttft_ms == pytest.approx(20 + 512 / 2000 * 1e3 + 10)  # priors: one step, 2,000 t/s
    for _ in range(10):
        pol.transfer.observe(100, 0.105)  # transfers seen taking 105 ms
    again = pol.route(100, 8, {}, [view("p", **STEPS, pending_prefill_tokens=412)], [view("d")])
    assert again.predicted_ttft_ms == pytest.approx(40 + 512 + 105, rel=0.01)


def test_round_robin_alternates_and_equal_costs_spread():
    for routing in ("round_robin", "prefix_aware"):
        pol = Policy(routing, 16, 64)
        picks = [pol.route(100, 8, {}, [view("p0"), view("p1")], [view("d")]).prefill for _ in range(4)]
        assert sorted(picks) == ["p0", "p0", "p1", "p1"], routing


async def _run(p, d, rid, prompt, params):
    res = await p.prefill(PrefillRequest(rid, prompt, params, d.kv_address))
    tokens = list(res.token_ids)
    if res.finished:
        return res, tokens, None
    last = None
    async for delta in d.generate(DecodeRequest(rid, params)):
        tokens += delta.token_ids
        last = delta
    return res, tokens, last


def test_prefill_and_decode_workers_match_one_engine(tiny, workers):
    p, d = workers
    prompts = random_prompts(6, [5, 16, 40, 70], vocab=tiny.config.vocab_size)

    async def all_of_them():
        return await asyncio.gather(*(_run(p, d, f"w{i}", pr, dataclasses.replace(GREEDY))
                                      for i, pr in enumerate(prompts)))
    results = asyncio.run(all_of_them())
    want = generate_ids(make_engine(tiny, num_blocks=256), prompts)
    for (res, tokens, last), ref, prompt in zip(results, want, prompts):
        assert tokens == ref and last.finished and last.all_token_ids == ref
        assert res.kv_blocks_sent == -(-len(prompt) // 16) and res.prefill_ms > 0
    for w in workers:
        s = w.engine.stats()
        assert (s.num_running, s.num_waiting, s.num_reserved, s.num_free_blocks) == (0, 0, 0, s.num_blocks)


def test_a_request_ending_at_its_first_token_frees_the_decode_side(tiny, workers):
    p, d = workers
    params = dataclasses.replace(GREEDY, max_tokens=1)
    res, tokens, last = asyncio.run(_run(p, d, "one", random_prompts(1, [40], seed=3)[0], params))
    assert res.finished and res.finish_reason == "length" and len(tokens) == 1 and last is None
    assert d.engine.stats().num_reserved == 0 and d.engine.stats().num_free_blocks == CFG.num_blocks


def test_workers_publish_their_blocks_and_hits_to_redis(tiny, workers, redis_url):
    p, d = workers
    prompt = random_prompts(1, [64], seed=9, vocab=tiny.config.vocab_size)[0]
    asyncio.run(_run(p, d, "pub", prompt, dataclasses.replace(GREEDY, max_tokens=4)))
    index = PrefixIndex(connect(redis_url), "unit")
    hashes = hash_prompt_blocks(prompt, 16, p.engine.scope)
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and index.lookup(hashes) != {"prefill-0": 4, "decode-0": 4}:
        time.sleep(0.05)
    assert index.lookup(hashes) == {"prefill-0": 4, "decode-0": 4}
    assert index.hit_counts().per_worker["prefill-0"][0] >= 64
    assert {w.name for w in index.workers()} == {"prefill-0", "decode-0"}


def test_an_aborted_stream_ends_with_abort_and_frees_its_blocks(tiny, workers):
    _, d = workers
    prompt = random_prompts(1, [40], seed=5, vocab=tiny.config.vocab_size)[0]

    async def run():
        gen = d.generate(DecodeRequest("ab", dataclasses.replace(GREEDY, max_tokens=200), prompt))
        first = await anext(gen)
        d.abort("ab")
        rest = [delta async for delta in gen]
        return first, rest
    first, rest = asyncio.run(run())
    assert not first.finished and first.queue_ms >= 0 and first.prefill_ms > 0
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    s = d.engine.stats()
    assert (s.num_running, s.num_free_blocks) == (0, s.num_blocks)


@pytest.mark.parametrize("where", ["decode", "prefill"])  # prefill: a request that stays where it is prefilled
def test_a_client_that_goes_away_aborts_the_request(tiny, workers, where):
    w = workers[where == "decode"]
    prompt = random_prompts(1, [40], seed=6, vocab=tiny.config.vocab_size)[0]

    async def run():
        gen = w.generate(DecodeRequest(f"gone-{where}", dataclasses.replace(GREEDY, max_tokens=200), prompt))
        await anext(gen)
        await gen.aclose()  # what Ray does when the router stops reading
        return w.engine.stats()  # NOTE: read before the event loop ends: the abort has run by now, not at collection
    s = asyncio.run(run())
    assert (s.num_running, s.num_free_blocks) == (0, s.num_blocks)


def wait_for(fn, want, timeout=5.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and fn() != want:
        time.sleep(0.05)
    return fn()


def test_the_index_follows_evictions_and_restarts(tiny, redis_url):
    """A small pool evicts; the worker's events remove its entries. A restart (new epoch) drops the rest."""
    spec = WorkerSpec("decode-small", "colocated", "tiny", EngineConfig(num_blocks=10, num_threads=2),
                      TransferConfig(), redis_url, "evict")
    w = DecodeWorker(spec, tiny)
    index = PrefixIndex(connect(redis_url), "evict")
    a, b, c = random_prompts(3, [64], seed=11, vocab=tiny.config.vocab_size)
    hashes = hash_prompt_blocks(a, 16, w.engine.scope)

    async def run(rid, prompt):
        async for _ in w.generate(DecodeRequest(rid, dataclasses.replace(GREEDY, max_tokens=8), prompt)):
            pass
    try:
        asyncio.run(run("a", a))
        assert wait_for(lambda: index.lookup(hashes), {"decode-small": 4}) == {"decode-small": 4}
        asyncio.run(run("b", b))
        asyncio.run(run("c", c))  # 10 blocks hold two 72-token requests at most: a's blocks were reused
        assert wait_for(lambda: index.lookup(hashes), {}) == {}
        assert index.lookup(hash_prompt_blocks(c, 16, w.engine.scope)) == {"decode-small": 4}
    finally:
        w.close()
    assert index.lookup(hash_prompt_blocks(c, 16, w.engine.scope)) == {}  # unregistered on close
    again = DecodeWorker(spec, tiny)
    try:
        assert again.epoch > w.epoch
    finally:
        again.close()


def test_logs_carry_the_request_id_across_prefill_transfer_and_decode(tiny, workers, capsys):
    import json
    import logging

    from cluster import logs

    p, d = workers
    logs.configure("test-worker", "DEBUG", "json")
    try:
        prompt = random_prompts(1, [40], seed=21, vocab=tiny.config.vocab_size)[0]
        asyncio.run(_run(p, d, "traced-1", prompt, dataclasses.replace(GREEDY, max_tokens=3)))
    finally:
        logs.configure("test-worker", "WARNING", "text")
        logging.getLogger().setLevel(logging.WARNING)
    records = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    by_logger = {r["logger"]: r for r in records if r["request_id"] == "traced-1"}
    assert {"prefill_workers.worker", "kv_transfer.sender", "decode_workers.worker"} <= set(by_logger), records
    assert all(r["component"] == "test-worker" for r in by_logger.values())


def test_an_abort_that_overtakes_its_request_still_stops_it(tiny, workers):
    """Ray runs an async actor's calls in no fixed order: an abort may arrive before the call it aborts."""
    from cluster.worker import RequestAborted

    p, d = workers
    prompt = random_prompts(1, [40], seed=8, vocab=tiny.config.vocab_size)[0]
    d.abort("early")

    async def run():
        async for _ in d.generate(DecodeRequest("early", dataclasses.replace(GREEDY, max_tokens=50), prompt)):
            pass
    with pytest.raises(RequestAborted):
        asyncio.run(run())
    p.abort("early-p")
    with pytest.raises(RequestAborted):
        asyncio.run(p.prefill(PrefillRequest("early-p", prompt, dataclasses.replace(GREEDY), d.kv_address)))
    for w in workers:
        s = w.engine.stats()
        assert (s.num_running, s.num_reserved, s.num_free_blocks) == (0, 0, s.num_blocks)
    asyncio.run(run())  # the abort is spent: the same id may be used again


def test_a_request_kept_on_the_prefill_worker_streams_one_engines_tokens_and_text(tiny, workers):
    p, _ = workers
    prompt = random_prompts(1, [70], seed=11, vocab=tiny.config.vocab_size)[0]
    params = dataclasses.replace(GREEDY, max_tokens=12, logprobs=1)

    async def stream():
        return [delta async for delta in p.generate(DecodeRequest("stay-1", dataclasses.replace(params), prompt))]
    deltas = asyncio.run(stream())
    engine = make_engine(tiny, num_blocks=256)
    engine.add_request("alone", prompt, dataclasses.replace(params))
    ref = run_to_completion(engine)["alone"]
    last = deltas[-1]
    assert [t for d in deltas for t in d.token_ids] == ref.token_ids == last.all_token_ids
    assert "".join(d.text for d in deltas) == ref.text == last.final_text
    assert last.finished and last.finish_reason == "length" and deltas[0].prefill_ms > 0
    assert [lp.token_id for d in deltas for lp in d.logprobs] == ref.token_ids  # the decode worker's deltas' fields
    assert all(d.made_at > 0 for d in deltas)
    s = p.engine.stats()
    assert (s.num_running, s.num_waiting, s.num_free_blocks) == (0, 0, s.num_blocks)


def test_a_stream_nobody_reads_pauses_in_the_engine_and_resumes_with_the_same_tokens(tiny, workers):
    """Its sequence stops at the window while another stream on the worker decodes on; read again, it finishes with
    the tokens of a run that never paused."""
    from tests.helpers import run_alone

    _, d = workers
    held_prompt, other_prompt = random_prompts(2, [24], seed=41, vocab=tiny.config.vocab_size)
    window, params = 4, dataclasses.replace(GREEDY, max_tokens=48)

    def engine_seqs():
        return d.loop.call(lambda e: {s.request_id: s.num_output_tokens for s in e.scheduler.paused})

    async def scenario():
        held = d.generate(DecodeRequest("held", params, held_prompt, window=window))
        tokens = list((await anext(held)).token_ids)  # one delta read, then nothing
        other = [t async for delta in d.generate(DecodeRequest("other", params, other_prompt, window=window))
                 for t in delta.token_ids]
        paused = engine_seqs()  # NOTE: the engine is idle now: nothing else can advance it
        tokens += [t async for delta in held for t in delta.token_ids]
        return other, paused, tokens

    other, paused, tokens = asyncio.run(scenario())
    assert len(other) == 48  # the other stream decoded all the while
    assert list(paused) == ["held"] and paused["held"] <= window + 1, paused  # 48 steps ran, not for it
    assert tokens == run_alone(tiny, held_prompt, params)
    assert engine_seqs() == {} and d.engine.stats().num_running == 0
