"""The client gets exactly the text one engine would give, on every path through the cluster.

A real cluster (Ray actors, gRPC, the embedded Redis) with prefill skipping off, so every request crosses the
prefill → decode handoff, serves 20 prompts (14 completions, 6 chats; accents, CJK, Cyrillic, Hangul and emoji in
the output) with stop strings of 1–8 characters that occur in the answer and that do not, over gRPC and the
OpenAI HTTP front, unary and streamed, four at a time. Text and finish reason must equal one in-process engine's,
and the concatenated stream must equal the unary text. Then a decode worker is killed mid-stream: the continuation
on the other decode worker must give the same text again (stop strings straddling the failover point, characters
split across it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from engine import SamplingParams
from router.openai_api import start_http
from router.v1 import inference_pb2 as pb
from tests.helpers import make_engine, run_to_completion, start_test_cluster

pytestmark = pytest.mark.slow
NS = "test-text"
MAX_TOKENS = 24

COMPLETIONS = [
    "Le café du matin est", "日本の首都は", "中文：今天天气很好，我们", "Emoji story: 🐱🐶🐭",
    "Voilà, les élèves français étudient", "Crème brûlée recipe: first,", "Москва — столица", "한국어로 인사하면",
    "The sea is a vast", "Once upon a time, in a small village,", "Señor García dijo que mañana",
    "The symbol for euro is €, for yen is", "Naïve café owners in Zürich", "Ελληνικά: η θάλασσα είναι",
]
CHATS = [
    [{"role": "user", "content": "Say hello in Japanese."}],
    [{"role": "user", "content": "Translate 'good morning' to French and Spanish."}],
    [{"role": "user", "content": "What is 你好 in English?"}],
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Describe the sea."}],
    [{"role": "user", "content": "Write a short line about a café in Paris."}],
    [{"role": "user", "content": "Name three colours."}],
]
CLIENTS = ["grpc-unary", "grpc-stream", "http-unary", "http-stream"]


@dataclass(frozen=True)
class Case:
    """One request: a prompt (text) or a conversation, a stop string, and the client that sends it."""

    name: str
    prompt: str | None
    messages: list[dict[str, str]] | None
    stop: str
    client: str


@dataclass(frozen=True)
class Answer:
    text: str
    finish_reason: str
    streamed: str | None = None  # the concatenated chunks of a streamed answer
    prefill_worker: str = ""  # gRPC only: who computed the first token ("" = the handoff was skipped)


@pytest.fixture(scope="module")
def cluster(ray_session):
    def edit(config):
        config.decode.replicas = 2
        config.decode.max_restarts = 1

    # NOTE: prefill skipping and the SLO placement off: a decode worker that caches a prompt, or that the router
    # prefers while the prefill worker is busy with the other requests in flight, must not serve it alone here
    c, server = start_test_cluster("deploy/local.yaml", NS, edit=edit, port=0, skip_prefill_max_uncached_tokens=0,
                                   slo_itl_ms=None)

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, server.loop).result(30)

    runner, http_port = on_loop(start_http(server.router, host="127.0.0.1", port=0, model_name="smollm2"))
    yield c, server, http_port
    on_loop(runner.cleanup())
    server.close()
    c.stop()


@pytest.fixture(scope="module")
def engine(smollm2):
    return make_engine(smollm2, num_blocks=2048)


def one_engine(engine, prompts: list[str], stops: list[list[str]], max_tokens: int = MAX_TOKENS,
               ignore_eos: bool = False) -> list[tuple[str, str]]:
    """Text and finish reason of one in-process engine doing both phases (the reference), batched."""
    ids = [f"ref-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt, stop in zip(ids, prompts, stops):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                       stop=[s for s in stop if s], ignore_eos=ignore_eos))
    out = run_to_completion(engine)
    return [(out[rid].text, out[rid].finish_reason or "") for rid in ids]


def prompt_of(engine, case: Case) -> str:
    return case.prompt if case.prompt is not None else engine.tokenizer.apply_chat_template(case.messages)


def stops_for(text: str, i: int) -> tuple[str, str]:
    """A stop string of 1–8 characters that occurs in `text` (taken from its middle) and one that does not."""
    length = 1 + i % 8
    start = max(0, min(len(text) - length, len(text) // 3 + i % 3))
    present = text[start:start + length]
    absent = ("@#" * 4)[:length]
    assert absent not in text
    return present, absent


def cases(engine) -> list[Case]:
    out = []
    items = [(f"completion {i}", p, None) for i, p in enumerate(COMPLETIONS)]
    items += [(f"chat {i}", None, m) for i, m in enumerate(CHATS)]
    texts = one_engine(engine, [p or engine.tokenizer.apply_chat_template(m) for _, p, m in items], [[]] * len(items))
    for i, ((name, prompt, messages), (text, _)) in enumerate(zip(items, texts)):
        for j, stop in enumerate(stops_for(text, i)):
            out.append(Case(f"{name} stop={stop!r}", prompt, messages, stop, CLIENTS[(i + 2 * j) % len(CLIENTS)]))
    return out


def via_grpc(stub, case: Case, stream: bool) -> Answer:
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=[case.stop])
    if case.messages is not None:
        req: Any = pb.ChatRequest(messages=[pb.ChatMessage(**m) for m in case.messages], sampling=sampling)
        unary, streamed = stub.Chat, stub.ChatStream
    else:
        req = pb.GenerateRequest(prompt=case.prompt, sampling=sampling)
        unary, streamed = stub.Generate, stub.GenerateStream
    if not stream:
        resp = unary(req, timeout=120)
        return Answer(resp.text, resp.finish_reason, prefill_worker=resp.timeline.prefill_worker)
    chunks = list(streamed(req, timeout=120))
    text = "".join(c.text for c in chunks)
    return Answer(text, chunks[-1].finish_reason, text, chunks[-1].timeline.prefill_worker)


def via_http(client: openai.OpenAI, case: Case, stream: bool) -> Answer:
    common: dict[str, Any] = {"model": "smollm2", "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [case.stop]}
    if case.messages is not None:
        if not stream:
            choice = client.chat.completions.create(messages=case.messages, **common).choices[0]
            return Answer(choice.message.content or "", choice.finish_reason)
        parts, reason = [], ""
        for chunk in client.chat.completions.create(messages=case.messages, stream=True, **common):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                reason = chunk.choices[0].finish_reason or reason
        return Answer("".join(parts), reason, "".join(parts))
    if not stream:
        c = client.completions.create(prompt=case.prompt, **common).choices[0]
        return Answer(c.text, c.finish_reason)
    parts, reason = [], ""
    for chunk in client.completions.create(prompt=case.prompt, stream=True, **common):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
    return Answer("".join(parts), reason, "".join(parts))


def test_every_client_gets_the_text_of_one_engine(cluster, engine) -> None:
    _, server, http_port = cluster
    stub = server.stub()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=120)
    send: dict[str, Callable[[Case], Answer]] = {
        "grpc-unary": lambda c: via_grpc(stub, c, False), "grpc-stream": lambda c: via_grpc(stub, c, True),
        "http-unary": lambda c: via_http(client, c, False), "http-stream": lambda c: via_http(client, c, True)}
    all_cases = cases(engine)
    assert len(all_cases) == 40 and {c.client for c in all_cases} == set(CLIENTS)
    wrong, non_ascii = [], 0
    wants = one_engine(engine, [prompt_of(engine, c) for c in all_cases], [[c.stop] for c in all_cases])
    # NOTE: 4 at a time, as clients send: each still crosses the handoff, and the reference is one batched engine
    with ThreadPoolExecutor(4) as pool:
        gots = list(pool.map(lambda c: send[c.client](c), all_cases))
    for case, want, got in zip(all_cases, wants, gots, strict=True):
        non_ascii += any(ord(ch) > 127 for ch in want[0])
        if (got.text, got.finish_reason) != want:
            wrong.append(f"{case.client} {case.name}: got {got.text!r} ({got.finish_reason}), want {want[0]!r} "
                         f"({want[1]})")
        if case.client.startswith("grpc") and not got.prefill_worker:
            wrong.append(f"{case.client} {case.name}: the handoff was skipped (no prefill worker)")
    assert wrong == [], "\n".join(wrong)
    assert non_ascii >= 12, "too few answers with non-ASCII text: the prompts no longer test it"


def test_stream_and_unary_agree_for_the_same_request(cluster, engine) -> None:
    _, server, _ = cluster
    stub = server.stub()
    texts = one_engine(engine, COMPLETIONS[:6], [[]] * 6)
    asked = [Case(prompt, prompt, None, stop, "") for i, (prompt, (text, _)) in enumerate(zip(COMPLETIONS[:6], texts))
             for stop in stops_for(text, i + 1)]
    with ThreadPoolExecutor(4) as pool:
        pairs = list(pool.map(lambda c: (via_grpc(stub, c, False), via_grpc(stub, c, True)), asked))
    for case, (unary, streamed) in zip(asked, pairs, strict=True):
        assert (streamed.streamed, streamed.finish_reason) == (unary.text, unary.finish_reason), case


# ---- failover -------------------------------------------------------------------------------------------------
FAILOVER_PROMPTS = ["日本の首都は", "中文：今天天气很好，我们", "Emoji story: 🐱🐶🐭", "Москва — столица",
                    "Voilà, les élèves français étudient", "한국어로 인사하면"]
FAILOVER_TOKENS = 48


def failover_stops(engine) -> list[list[str]]:
    """Per prompt: a stop string that spans the answer's late part (it may straddle the failover) and an absent one."""
    out = []
    texts = one_engine(engine, FAILOVER_PROMPTS, [[]] * len(FAILOVER_PROMPTS), FAILOVER_TOKENS, ignore_eos=True)
    for i, (text, _) in enumerate(texts):
        late = text[len(text) * 2 // 3: len(text) * 2 // 3 + 2 + i % 5]
        out.append([late, ("@#" * 4)[: 2 + i % 7]] if late.strip() else [("@#" * 4)[: 2 + i % 7]])
    return out


def test_a_decode_worker_killed_mid_stream_changes_no_text(cluster, engine, ray_session) -> None:
    c, server, _ = cluster
    stops = failover_stops(engine)
    want = one_engine(engine, FAILOVER_PROMPTS, stops, FAILOVER_TOKENS, ignore_eos=True)
    stub = server.stub()
    started = threading.Event()

    def stream(i: int) -> tuple[str, str]:
        req = pb.GenerateRequest(prompt=FAILOVER_PROMPTS[i], sampling=pb.SamplingParams(
            max_tokens=FAILOVER_TOKENS, temperature=0, ignore_eos=True, stop=stops[i]))
        text, reason, n = "", "", 0
        for chunk in stub.GenerateStream(req, timeout=300):
            text += chunk.text
            reason = chunk.finish_reason or reason
            n += len(chunk.token_ids)
            if n >= 6:
                started.set()
        return text, reason

    with ThreadPoolExecutor(len(FAILOVER_PROMPTS)) as pool:
        futures = [pool.submit(stream, i) for i in range(len(FAILOVER_PROMPTS))]
        assert started.wait(180)
        loads = {n: ray_session.get(c.actors[n].load.remote(), timeout=30) for n in ("decode-0", "decode-1")}
        victim = max(loads, key=lambda n: loads[n].running)
        assert loads[victim].running > 0, loads
        ray_session.kill(ray_session.get_actor(victim, namespace=NS), no_restart=False)
        got = [f.result(timeout=300) for f in futures]
    for prompt, stop, g, w in zip(FAILOVER_PROMPTS, stops, got, want):
        assert g == w, f"{prompt!r} stop={stop!r}: got {g!r}, want {w!r}"
