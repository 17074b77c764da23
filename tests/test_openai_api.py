"""The OpenAI-compatible HTTP front end to end: the official `openai` client, raw HTTP and curl against one cluster.

One 1-prefill + 1-decode cluster (deploy/local.yaml) serves the module with two HTTP fronts on its router's event
loop: an open one and one that needs an API key. Outputs are compared with one in-process engine's greedy output.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import shlex
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import openai
import pytest

from cluster.messages import WorkerLoad
from engine import SamplingParams
from router.openai_api import start_http
from tests.helpers import RouterServer, make_engine, run_to_completion, start_test_cluster

pytestmark = pytest.mark.slow

API_KEY = "sk-pdcluster-test-7f3a9c"
WRONG_KEY = "sk-wrong-key-5e1d22"
MESSAGES = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a colour."}]
PROMPT = "The capital of France is"
# The README's examples, run as they are written (the test swaps port 8000 for the one it bound).
CURL_EXAMPLES = (
    "curl -s http://127.0.0.1:8000/v1/models",
    "curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d "
    "'{\"model\": \"smollm2\", \"messages\": [{\"role\": \"system\", \"content\": \"You are brief.\"}, "
    "{\"role\": \"user\", \"content\": \"Name a colour.\"}], \"max_tokens\": 16, \"temperature\": 0}'",
    "curl -sN http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d "
    "'{\"model\": \"smollm2\", \"messages\": [{\"role\": \"system\", \"content\": \"You are brief.\"}, "
    "{\"role\": \"user\", \"content\": \"Name a colour.\"}], \"max_tokens\": 16, \"temperature\": 0, "
    "\"stream\": true, \"stream_options\": {\"include_usage\": true}}'",
    "curl -s http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d "
    "'{\"model\": \"smollm2\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16, \"temperature\": 0}'",
)


@dataclass
class Front:
    cluster: Any
    server: RouterServer
    port: int  # no API key
    keyed_port: int  # needs API_KEY

    def client(self, api_key: str = "unused", keyed: bool = False) -> openai.OpenAI:
        port = self.keyed_port if keyed else self.port
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def front(ray_session):
    c, server = start_test_cluster("deploy/local.yaml", "test-openai", port=0)

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, server.loop).result(30)

    runners = []
    try:
        runner, port = on_loop(start_http(server.router, host="127.0.0.1", port=0, model_name="smollm2"))
        runners.append(runner)
        runner, keyed_port = on_loop(start_http(server.router, host="127.0.0.1", port=0, model_name="smollm2",
                                                api_keys=frozenset({API_KEY})))
        runners.append(runner)
        yield Front(c, server, port, keyed_port)
    finally:
        for r in runners:
            on_loop(r.cleanup())
        server.close()
        c.stop()


@pytest.fixture(scope="module")
def reference(smollm2):
    """Greedy output (token ids, text) of one colocated engine for a text prompt."""
    engine = make_engine(smollm2, num_blocks=2048)
    cache: dict[tuple[str, int], tuple[list[int], str]] = {}

    def run(prompt: str, max_tokens: int = 16) -> tuple[list[int], str]:
        if (prompt, max_tokens) not in cache:
            rid = f"ref{len(cache)}"
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
            out = run_to_completion(engine)[rid]
            cache[(prompt, max_tokens)] = (out.token_ids, out.text)
        return cache[(prompt, max_tokens)]
    return run


def post(port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """A raw POST; the status and the JSON body (error statuses included)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def served(front: Front, status: str) -> float:
    """How many HTTP requests the router counted with this gRPC status name (pdcluster_requests_total)."""
    value = front.server.router.metrics.registry.get_sample_value("pdcluster_requests_total",
                                                                  {"api": "http", "status": status})
    return value or 0.0


def assert_openai_error(body: dict[str, Any], kind: str, param: str | None) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == kind and err["param"] == param, err


def test_health_and_models(front):
    with urllib.request.urlopen(f"http://127.0.0.1:{front.port}/health", timeout=10) as r:
        assert (r.status, json.loads(r.read())) == (200, {"status": "ok"})
    models = front.client().models.list()
    assert [m.id for m in models.data] == ["smollm2"]
    assert models.data[0].owned_by == "pdcluster"


def test_chat_completion_matches_the_engine(front, reference, smollm2):
    template = smollm2.tokenizer.apply_chat_template(MESSAGES)
    want_ids, want_text = reference(template)
    n_prompt = len(smollm2.tokenizer.encode(template))
    client = front.client()
    ok_before = served(front, "OK")
    r = client.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0, max_tokens=16)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want_text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(want_ids))
    assert r.usage.total_tokens == n_prompt + len(want_ids)
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens <= n_prompt
    timeline = r.model_extra["pdcluster"]["timeline"]  # pdcluster's own key, which OpenAI clients keep as extra
    assert timeline["decode_worker"] == "decode-0" and timeline["first_token_ms"] <= timeline["total_ms"]

    chunks = list(client.chat.completions.create(model="smollm2", messages=MESSAGES, temperature=0, max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want_text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[:-1] == [None] * (len(finishes) - 1) and finishes[-1] in ("stop", "length")
    usage = chunks[-1].usage  # the usage chunk comes last, with no choices
    assert not chunks[-1].choices and (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, len(want_ids))
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again: its full blocks are cached
    assert served(front, "OK") == ok_before + 2


def test_completions_match_the_engine(front, reference, smollm2):
    want_ids, want_text = reference(PROMPT)
    client = front.client()
    r = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=16)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == want_text and r.usage.completion_tokens == len(want_ids)
    assert r.usage.prompt_tokens == len(smollm2.tokenizer.encode(PROMPT))
    ids = client.completions.create(model="smollm2", prompt=smollm2.tokenizer.encode(PROMPT), temperature=0,
                                    max_tokens=16)
    assert ids.choices[0].text == want_text  # a prompt of token ids

    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=16,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == len(want_ids)


@pytest.mark.parametrize("kwargs, error, param", [
    (dict(top_p=1.5), openai.BadRequestError, "top_p"),
    # NOTE: an unknown field is ignored (as vLLM does); a known one out of its range is refused
    (dict(extra_body={"repetition_penalty": 2.5}), openai.BadRequestError, "repetition_penalty"),
    (dict(model="gpt-4o"), openai.NotFoundError, "model"),
    (dict(n=17), openai.BadRequestError, "n"),
    (dict(prompt=["one prompt", "and another"]), openai.BadRequestError, "prompt"),
    (dict(logprobs=21), openai.BadRequestError, "logprobs"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(temperature="hot"), openai.BadRequestError, "temperature"),
])
def test_bad_requests_are_openai_errors_naming_the_parameter(front, kwargs, error, param):
    args: dict[str, Any] = dict(model="smollm2", prompt=PROMPT, max_tokens=4)
    args.update(kwargs)
    status = "NOT_FOUND" if error is openai.NotFoundError else "INVALID_ARGUMENT"
    before = served(front, status)
    with pytest.raises(error) as info:
        front.client().completions.create(**args)
    assert info.value.status_code == (404 if error is openai.NotFoundError else 400)
    assert served(front, status) == before + 1
    assert param in info.value.message
    assert info.value.body["param"] == param  # type: ignore[index]
    if error is openai.NotFoundError:
        assert info.value.code == "model_not_found"


def test_bad_chat_requests_name_the_message_field(front):
    client = front.client()
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].role"):
        client.chat.completions.create(model="smollm2", messages=[{"role": "robot", "content": "hi"}], max_tokens=4)
    image = [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[0\]"):
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": image}], max_tokens=4)
    parts = [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour."}]
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": parts}], max_tokens=2)
    assert r.usage.completion_tokens >= 1


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b""])
def test_a_body_that_is_not_a_json_object_is_400(front, body):
    status, reply = post(front.port, "/v1/completions", body)
    assert status == 400
    assert_openai_error(reply, "invalid_request_error", "body")


def test_api_keys_are_required_and_never_logged(front, caplog):
    caplog.set_level(logging.DEBUG, logger="router")
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    with pytest.raises(openai.AuthenticationError) as info:
        front.client(WRONG_KEY, keyed=True).models.list()
    assert info.value.status_code == 401 and info.value.body["type"] == "authentication_error"  # type: ignore[index]
    status, reply = post(front.keyed_port, "/v1/completions", json.dumps({"prompt": PROMPT}).encode())
    assert status == 401
    assert_openai_error(reply, "authentication_error", None)
    with urllib.request.urlopen(f"http://127.0.0.1:{front.keyed_port}/health", timeout=10) as r:
        assert r.status == 200  # health needs no key
    good = front.client(API_KEY, keyed=True)
    assert [m.id for m in good.models.list().data] == ["smollm2"]
    assert good.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2).usage.completion_tokens >= 1
    deadline = time.monotonic() + 5
    while not any(r.name == "aiohttp.access" for r in caplog.records) and time.monotonic() < deadline:
        time.sleep(0.05)  # the access log line is written after the response went out
    ours = [r for r in caplog.records if r.name.startswith(("router", "aiohttp"))]
    assert any(r.name == "aiohttp.access" for r in ours)  # the logs were captured ...
    for r in ours:  # ... and hold neither key
        text = r.getMessage() + str(r.args) + str(getattr(r, "exc_text", ""))
        assert API_KEY not in text and WRONG_KEY not in text, r.name


def test_curl_examples_work_as_written(front, reference, smollm2):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    want = reference(smollm2.tokenizer.apply_chat_template(MESSAGES))[1]

    def curl(command: str) -> str:
        argv = shlex.split(command.replace("127.0.0.1:8000", f"127.0.0.1:{front.port}"))
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout

    models, chat, chat_stream, completion = (curl(c) for c in CURL_EXAMPLES)
    assert json.loads(models)["data"][0]["id"] == "smollm2"
    assert json.loads(chat)["choices"][0]["message"]["content"] == want
    events = [line.removeprefix("data: ") for line in chat_stream.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == want
    assert chunks[-1]["usage"]["completion_tokens"] >= 1
    assert json.loads(completion)["choices"][0]["text"] == reference(PROMPT)[1]


def open_stream(port: int, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streaming completion of `max_tokens` tokens (EOS ignored) that has sent its first event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.readline().startswith(b"data: {")
    return conn, resp


def wait_idle(front: Front, within_s: float) -> list[dict[str, float]]:
    """Every worker's load once all its KV blocks are free and nothing runs (or the last seen, at the deadline)."""
    import ray

    deadline = time.monotonic() + within_s
    while True:
        loads = [ray.get(a.load.remote(), timeout=30) for a in front.cluster.actors.values()]
        if is_idle(loads) or time.monotonic() > deadline:
            return loads
        time.sleep(0.1)


def is_idle(loads: list[WorkerLoad]) -> bool:
    return all(x.free_blocks == x.num_blocks and x.running == x.reserved == 0 for x in loads)


def test_a_client_that_disconnects_mid_stream_frees_the_kv_blocks(front):
    # NOTE: 1000 tokens take far longer than the 5 s allowed: only an abort frees the blocks that soon.
    cancelled = served(front, "CANCELLED")
    conn, resp = open_stream(front.port, 1000)
    resp.close()
    conn.close()
    loads = wait_idle(front, 5)
    assert is_idle(loads), loads
    assert front.server.router.inflight == 0
    assert served(front, "CANCELLED") == cancelled + 1


def test_a_failure_after_the_stream_started_is_an_error_event(front):
    router = front.server.router
    saved, router.settings.request_timeout_s = router.settings.request_timeout_s, 3.0
    timed_out = served(front, "DEADLINE_EXCEEDED")
    try:
        conn, resp = open_stream(front.port, 1000)
        events = [line.removeprefix(b"data: ") for line in resp.read().split(b"\n\n") if line.strip()]
        conn.close()
    finally:
        router.settings.request_timeout_s = saved
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])
    assert_openai_error(error, "server_error", None)
    assert "in time" in error["error"]["message"]
    assert is_idle(wait_idle(front, 5))
    assert served(front, "DEADLINE_EXCEEDED") == timed_out + 1
