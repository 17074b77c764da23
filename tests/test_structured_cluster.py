"""Structured outputs over a real cluster (one prefill, two decode workers) where every request crosses the
prefill -> decode handoff: the grammar's state is rebuilt on the decode worker from the prefill worker's first token,
and on a second decode worker when the first is killed mid-stream.

Through the official openai client (chat and completions, unary and streamed): every output for a set of JSON
schemas parses and validates, guided_regex / guided_choice outputs match, and a bad schema or regex is a 400 naming
the parameter. Over gRPC (StructuredOutput): a decode worker killed mid-stream, and every stream still ends in
exactly the JSON an undisturbed single engine writes.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from engine import SamplingParams
from engine.grammar import StructuredOutputSpec
from router.openai_api import start_http
from router.v1 import inference_pb2 as pb
from tests.helpers import make_engine, run_to_completion, start_test_cluster
from tests.test_structured_output import QUESTIONS, SCHEMAS

pytestmark = pytest.mark.slow
NS = "test-structured"


@pytest.fixture(scope="module")
def front(ray_session):
    def edit(config):
        config.decode.replicas = 2
        config.router.max_predicted_ttft_ms = 600_000  # NOTE: admission is not what this tests (a busy CI machine)

    # NOTE: every request crosses the handoff: no prefix skip, and no SLO rule that has a decode worker prefill
    c, server = start_test_cluster("deploy/local.yaml", NS, edit=edit, port=0, skip_prefill_max_uncached_tokens=0,
                                   slo_itl_ms=None)

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, server.loop).result(30)

    runner, port = on_loop(start_http(server.router, host="127.0.0.1", port=0, model_name="smollm2"))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    yield c, server, client
    on_loop(runner.cleanup())
    server.close()
    c.stop()


def fresh(text: str) -> str:
    """A prompt no worker has cached (so it is prefilled on the prefill worker and handed off)."""
    return f"[{time.monotonic_ns()}] {text}"


def test_json_schemas_through_the_openai_client_parse_and_validate(front):
    _, _, client = front

    def one(job: tuple[str, bool]) -> tuple[str, str, str | None]:
        name, stream = job
        body: dict[str, Any] = dict(model="smollm2", max_tokens=200, temperature=0.7, seed=3,
                                    messages=[{"role": "user", "content": fresh(QUESTIONS.get(name, "Any JSON."))}])
        if name == "object":
            body["response_format"] = {"type": "json_object"}
            body["messages"][0]["content"] = fresh('Answer as a JSON object {"answer": "yes" or "no"}: is ice cold?')
            # NOTE: greedy: any JSON object is allowed here, and a sampled one can wander into a string that runs to
            # max_tokens (seen once in CI: a valid prefix, finish "length"); the schemas bound theirs
            body["temperature"] = 0
        else:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
        if not stream:
            reply = client.chat.completions.create(**body)
            return name, reply.choices[0].message.content or "", reply.choices[0].finish_reason
        text, finish = "", None
        for chunk in client.chat.completions.create(**body, stream=True):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return name, text, finish

    jobs = [(name, i % 2 == 1) for i, name in enumerate([*SCHEMAS, "object"])]  # unary and streamed
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(one, jobs))
    for name, text, finish in results:
        assert finish == "stop", (name, text)
        value = json.loads(text)
        if name == "object":
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, SCHEMAS[name])


def test_guided_regex_and_choice_match(front):
    _, _, client = front
    phone = client.completions.create(model="smollm2", prompt=fresh("Call me at"), max_tokens=30,
                                      extra_body={"guided_regex": r" \(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r" \(\d{3}\) \d{3}-\d{4}", phone.choices[0].text)
    colors = ["red", "green", "blue"]
    answer = client.chat.completions.create(
        model="smollm2", max_tokens=10, messages=[{"role": "user", "content": fresh("Name a color.")}],
        extra_body={"structured_outputs": {"choice": colors}})
    assert answer.choices[0].message.content in colors and answer.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "strng"}}}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs.regex"),
])
def test_a_bad_schema_or_regex_is_a_400_naming_it(front, extra, param):
    _, _, client = front
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", max_tokens=8, extra_body=extra,
                                       messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body  # type: ignore[index]


def test_a_decode_worker_killed_mid_stream_still_yields_the_same_valid_json(front, smollm2, ray_session):
    c, server, _ = front
    names = [*SCHEMAS, "person"]
    texts = [fresh(f"{QUESTIONS[name]} Example {i}.") for i, name in enumerate(names)]
    engine = make_engine(smollm2, num_blocks=1024)  # the undisturbed run: one engine, the same greedy requests
    for i, (text, name) in enumerate(zip(texts, names)):
        engine.add_request(f"r{i}", engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}])), SamplingParams(
                max_tokens=200, temperature=0, structured=StructuredOutputSpec.json_schema(SCHEMAS[name])))
    want = run_to_completion(engine)
    stub, counts, started = server.stub(), [0] * len(texts), threading.Event()
    failovers = server.router.metrics.registry.get_sample_value("pdcluster_failovers_total", {"kind": "decode"}) or 0

    def one(i: int) -> tuple[str, Any]:
        so = pb.StructuredOutput(json_schema=json.dumps(SCHEMAS[names[i]]))
        req = pb.ChatRequest(request_id=f"so-{time.monotonic_ns()}-{i}",
                             messages=[pb.ChatMessage(role="user", content=texts[i])],
                             sampling=pb.SamplingParams(max_tokens=200, temperature=0, structured_output=so))
        text, last = "", None
        for chunk in stub.ChatStream(req, timeout=300):
            text, last, counts[i] = text + chunk.text, chunk, counts[i] + len(chunk.token_ids)
            if min(counts) >= 4:  # NOTE: every stream is decoding (past the handoff) when the worker dies
                started.set()
        return text, last

    with ThreadPoolExecutor(len(texts)) as pool:
        futures = [pool.submit(one, i) for i in range(len(texts))]
        assert started.wait(120)
        running = {name: ray_session.get(c.actors[name].load.remote(), timeout=30).running
                   for name in ("decode-0", "decode-1")}
        victim = max(running, key=running.get)  # type: ignore[arg-type]
        ray_session.kill(ray_session.get_actor(victim, namespace=NS), no_restart=False)
        results = [f.result(timeout=600) for f in futures]
    for i, (text, last) in enumerate(results):
        assert last.finish_reason == "stop" and text == want[f"r{i}"].text, (text, want[f"r{i}"].text)
        jsonschema.validate(json.loads(text), SCHEMAS[names[i]])
        assert last.timeline.prefill_worker == "prefill-0"  # it crossed the handoff
    moved = server.router.metrics.registry.get_sample_value("pdcluster_failovers_total", {"kind": "decode"})
    assert moved is not None and moved > failovers  # streams did move off the killed worker mid-way
