"""The request features of issue 28 over a cluster where every request crosses the prefill → decode handoff:
logprobs (equal to transformers' on the same model), echo and prompt logprobs, n > 1 with a seed, penalties,
/tokenize and /detokenize, the gRPC fields, and every field refused before now served (or a 400 naming it).

One 1-prefill + 1-decode cluster (deploy/local.yaml, no prefill skip) with an HTTP front serves the module.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
import torch

from cluster.messages import Delta
from engine import SamplingParams
from router.openai_api import start_http
from router.streams import ChannelStream
from router.v1 import inference_pb2 as pb
from tests.helpers import make_engine, run_to_completion, start_test_cluster

pytestmark = pytest.mark.slow
NS = "test-features"
TOL = 1e-4  # float32 logprobs of the same weights: ours against transformers'


@pytest.fixture(scope="module")
def front(ray_session):
    # NOTE: every request crosses the handoff: no prefix skip, and no SLO rule that has the decode worker prefill a
    # short prompt itself
    c, server = start_test_cluster("deploy/local.yaml", NS, port=0, skip_prefill_max_uncached_tokens=0,
                                   slo_itl_ms=None)
    runner, port = server.run(start_http(server.router, host="127.0.0.1", port=0, model_name="smollm2"))
    try:
        yield server, port, c
    finally:
        server.run(runner.cleanup())
        server.close()
        c.stop()


@pytest.fixture(scope="module")
def engine(smollm2):
    """One in-process engine: what the cluster's answers must equal."""
    return make_engine(smollm2, num_blocks=1024)


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)


def fresh(text: str) -> str:
    """A prompt no cache holds: it crosses the handoff."""
    return f"[{time.monotonic_ns()}] {text}"


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ids_of(tokens: list[str]) -> list[int]:
    """Token ids from logprobs' token names under return_tokens_as_token_ids ("token_id:42")."""
    return [int(t.removeprefix("token_id:")) for t in tokens]


def reference_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of `ids` ([L, V]; row p scores token p + 1)."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_top(got: dict[int, float], row: torch.Tensor, k: int) -> None:
    """`got` (token id -> logprob) holds the reference's top `k` and each logprob is the reference's, where two tokens
    closer than TOL may rank either way (the prompts are fresh each run: a near tie at the k-th place comes up)."""
    assert max(abs(v - float(row[t])) for t, v in got.items()) < TOL
    top = row.topk(k).values.tolist()
    ranked = sorted((float(row[t]) for t in got), reverse=True)[:k]
    assert len(ranked) == k and max(abs(a - b) for a, b in zip(ranked, top, strict=True)) < TOL


def assert_crossed_handoff(extra: dict[str, Any]) -> None:
    timeline = extra["timeline"]
    assert timeline["prefill_worker"] and not timeline["prefill_skipped"], timeline


def engine_run(engine, prompt: str | list[int], params: SamplingParams) -> list[int]:
    rid = f"ref-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, params)
    return run_to_completion(engine)[rid].token_ids


def test_completion_echo_and_logprobs_equal_transformers(front, hf_smollm2):
    server, port, _ = front
    resp = client(port).completions.create(
        model="smollm2", prompt=fresh("The old bridge over the river was built of"), max_tokens=6, temperature=0,
        logprobs=5, echo=True, extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    assert_crossed_handoff(resp.model_extra["pdcluster"])
    choice = resp.choices[0]
    lp = choice.logprobs
    ids = ids_of(lp.tokens)
    prompt_len = resp.usage.prompt_tokens
    assert len(ids) == prompt_len + 6 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert choice.text.startswith("[")  # echo: the prompt comes first
    ref = reference_logprobs(hf_smollm2, ids)
    for p in range(1, len(ids)):  # every prompt token after the first, then every sampled one
        row = ref[p - 1]
        assert abs(lp.token_logprobs[p] - float(row[ids[p]])) < TOL, p
        got = lp.top_logprobs[p]
        assert len(got) <= 6  # the top 5 and the chosen token
        assert_top(dict(zip(ids_of(list(got)), got.values(), strict=True)), row, 5)
    assert ids[prompt_len:] == ref[prompt_len - 1 : -1].argmax(-1).tolist()  # greedy: the argmax every time


def test_streamed_chat_logprobs_equal_transformers(front, hf_smollm2):
    server, port, _ = front
    messages = [{"role": "user", "content": fresh("Name three colours.")}]
    status, tok = post(port, "/tokenize", {"model": "smollm2", "messages": messages})
    assert status == 200 and tok["count"] == len(tok["tokens"])
    stream = client(port).chat.completions.create(
        model="smollm2", messages=messages, max_tokens=8, temperature=0.7, seed=3, logprobs=True, top_logprobs=4,
        stream=True, stream_options={"include_usage": True},
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    entries, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.logprobs is not None:
                entries += c.logprobs.content
    assert usage is not None and usage.prompt_tokens == tok["count"]  # /tokenize counts what the chat uses
    out = ids_of([e.token for e in entries])
    assert len(out) == 8
    ref = reference_logprobs(hf_smollm2, tok["tokens"] + out)
    for j, e in enumerate(entries):
        row = ref[tok["count"] - 1 + j]
        assert abs(e.logprob - float(row[out[j]])) < TOL  # before temperature: the model's own log-softmax
        got = ids_of([t.token for t in e.top_logprobs])
        assert len(got) == 4 and [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs),
                                                                               reverse=True)
        assert_top(dict(zip(got, (t.logprob for t in e.top_logprobs), strict=True)), row, 4)


def test_n_choices_with_a_seed_are_reproducible_and_differ(front, engine, ray_session):
    server, port, c = front
    prompt = fresh("Once upon a time, in a small village by the sea, there lived an old fisherman who every "
                   "morning rowed out past the rocks to cast his nets, and every evening he")
    prompt_len = len(engine.tokenize(prompt))
    args: dict[str, Any] = dict(model="smollm2", prompt=prompt, max_tokens=8, temperature=1.0, n=4, seed=123,
                                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=0)
    computed = ray_session.get(c.actors["prefill-0"].load.remote(), timeout=30).computed_tokens
    unary = client(port).completions.create(**args)
    computed = ray_session.get(c.actors["prefill-0"].load.remote(), timeout=30).computed_tokens - computed
    # the prompt's full blocks are computed once; each other choice recomputes only its last, partial block
    assert prompt_len + 3 <= computed <= prompt_len + 3 * 16, (computed, prompt_len)
    assert sorted(c.index for c in unary.choices) == [0, 1, 2, 3]
    assert unary.usage.completion_tokens == 32
    texts = {c.index: c.text for c in unary.choices}
    assert len(set(texts.values())) > 1  # each choice its own random stream
    streamed: dict[int, str] = {}
    for chunk in client(port).completions.create(**args, stream=True):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == texts  # the same seed: the same choices
    for c in unary.choices:  # choice i samples with seed + i, wherever it runs
        want = engine_run(engine, prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=123 + c.index,
                                                         ignore_eos=True))
        assert ids_of(c.logprobs.tokens) == want


def test_penalties_and_logit_bias_over_grpc_equal_the_engine(front, engine):
    server, port, _ = front
    text = fresh("Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat")
    plain = engine_run(engine, text, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    params = dict(max_tokens=12, temperature=0, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4,
                  frequency_penalty=0.3, logit_bias={plain[0]: -100.0})
    want = engine_run(engine, text, SamplingParams(**params))  # type: ignore[arg-type]
    assert want != plain and want[0] != plain[0]
    req = pb.GenerateRequest(prompt=text, sampling=pb.SamplingParams(**params, logprobs=2))
    ids, logprobs, last = [], [], None
    for chunk in server.stub().GenerateStream(req, timeout=120):
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        last = chunk
    assert ids == want  # the penalties' history (prompt and output) crossed the handoff
    assert last is not None and last.timeline.prefill_worker and not last.timeline.prefill_skipped
    assert [e.token_id for e in logprobs] == ids and all(len(e.top) == 2 for e in logprobs)
    resp = server.stub().Generate(pb.GenerateRequest(prompt=text, sampling=pb.SamplingParams(
        max_tokens=4, temperature=1.0, seed=9, n=3, logprobs=0)), timeout=120)
    assert [c.index for c in resp.choices] == [0, 1, 2] and resp.usage.completion_tokens == 12
    assert list(resp.token_ids) == list(resp.choices[0].token_ids) and len(resp.logprobs) == 4


def test_tokenize_detokenize_and_models(front, engine):
    server, port, _ = front
    status, tok = post(port, "/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 0
    assert tok["max_model_len"] == engine.max_model_len  # the model's, as an engine of its own loads it
    status, detok = post(port, "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"] == "Hello world"
    status, err = post(port, "/detokenize", {"tokens": [10**7]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = post(port, "/tokenize", {"model": "smollm2"})
    assert status == 400 and err["error"]["param"] == "prompt"
    models = client(port).models.list()
    assert models.data[0].model_extra["max_model_len"] == engine.max_model_len


# Fields refused before issue 28 (a value that changes the answer), a value each is served at, and what shows it
SERVED: list[tuple[str, Any, Any]] = [
    ("n", 2, lambda b: len(b["choices"]) == 2),
    ("presence_penalty", 0.5, None), ("frequency_penalty", -0.5, None), ("repetition_penalty", 1.2, None),
    ("min_p", 0.1, None),
    ("logit_bias", {"42": 100}, lambda b: b["choices"][0]["text"] == "::"),  # token 42 is ":": forced
    ("logprobs", 2, lambda b: len(b["choices"][0]["logprobs"]["token_logprobs"]) == 2),
    ("echo", True, lambda b: b["choices"][0]["text"].startswith("Hello")),
    ("prompt_logprobs", 1, lambda b: len(b["choices"][0]["prompt_logprobs"]) == b["usage"]["prompt_tokens"]),
    ("return_tokens_as_token_ids", True, None),  # changes the logprobs' token names (the tests above)
]
CHAT_SERVED = [("logprobs", True), ("top_logprobs", 0)]
STILL_REFUSED = [("best_of", 3), ("suffix", "x"), ("min_tokens", 2), ("use_beam_search", True),
                 ("include_stop_str_in_output", True), ("spaces_between_special_tokens", False)]
CHAT_STILL_REFUSED = [("echo", True)]  # NOTE: tools are served since issue 41 (tests/test_tool_calls_cluster.py)


def test_every_field_refused_before_is_served_or_named(front):
    server, port, _ = front
    base = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2, "temperature": 0.5, "seed": 1}
    chat = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for field, value, shows in SERVED:
        status, body = post(port, "/v1/completions", {**base, field: value})
        assert status == 200, (field, body)
        assert shows is None or shows(body), (field, body)
    for field, value in CHAT_SERVED:
        status, body = post(port, "/v1/chat/completions", {**chat, "logprobs": True, field: value})
        assert status == 200 and body["choices"][0]["logprobs"]["content"], (field, body)
    for path, req, table in (("/v1/completions", base, STILL_REFUSED), ("/v1/chat/completions", chat,
                                                                       CHAT_STILL_REFUSED)):
        for field, value in table:
            status, body = post(port, path, {**req, field: value})
            assert status == 400 and body["error"]["param"] == field, (field, body)


def test_stream_interval_sends_that_many_tokens_a_chunk_with_the_engines_text(front, engine, monkeypatch):
    """`router.stream_interval` (vLLM's and SGLang's --stream-interval): a stream's chunks carry at least that many
    tokens (the first token may go alone, the last chunk has what is left), over gRPC and HTTP, across the handoff,
    and the tokens and text are one engine's; the decode worker sends its tokens to the router in deltas of that
    many too (its first and last at once), so the router handles a delta per chunk, not per token."""
    server, port, _ = front
    params = SamplingParams(max_tokens=23, temperature=0, ignore_eos=True)
    deltas: list[int] = []  # the decode worker's deltas as the router's channel takes them: tokens in each
    put = ChannelStream.put

    def counted(stream: ChannelStream, item: object) -> None:
        if stream.kind == "generate" and isinstance(item, Delta):
            deltas.append(len(item.token_ids))
        put(stream, item)

    monkeypatch.setattr(ChannelStream, "put", counted)
    server.router.settings.stream_interval = 5
    try:
        for front_name in ("grpc", "http"):
            deltas.clear()
            text = fresh(f"Tell me a story about a lighthouse keeper ({front_name}).")
            want = engine_run(engine, text, params)
            if front_name == "grpc":
                chunks = [(list(c.token_ids), c.text, c) for c in server.stub().GenerateStream(pb.GenerateRequest(
                    prompt=text, sampling=pb.SamplingParams(max_tokens=23, temperature=0, ignore_eos=True)),
                    timeout=120)]
                assert chunks[-1][2].timeline.prefill_worker and not chunks[-1][2].timeline.prefill_skipped
            else:
                chunks = sse_chunks(port, {"prompt": text, "max_tokens": 23, "temperature": 0, "ignore_eos": True,
                                           "stream": True, "return_token_ids": True, "logprobs": 1})
            sizes = [len(ids) for ids, _, _ in chunks if ids]
            assert [t for ids, _, _ in chunks for t in ids] == want, front_name
            assert "".join(t for _, t, _ in chunks) == engine.tokenizer.decode(want), front_name
            assert all(n >= 5 for n in sizes[1:-1]) and len(sizes) <= 2 + 22 // 5, (front_name, sizes)
            # NOTE: 22 tokens after the prefill worker's: the decode worker's first at once, then 5 a delta
            assert sum(deltas) == 22 and all(n >= 5 for n in deltas[1:-1]) and len(deltas) <= 2 + 21 // 5, deltas
    finally:
        server.router.settings.stream_interval = 1


def sse_chunks(port: int, body: dict[str, Any]) -> list[tuple[list[int], str, None]]:
    """A streamed completion's events: each one's token ids and text."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    out = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            payload = line.removeprefix(b"data:").strip()
            if not payload or payload == b"[DONE]":
                continue
            for choice in json.loads(payload).get("choices") or []:
                ids = list(choice.get("token_ids") or [])
                # NOTE: a chunk of several tokens carries the logprobs of each
                assert len((choice.get("logprobs") or {}).get("tokens") or []) == len(ids)
                out.append((ids, choice.get("text") or "", None))
    return out
