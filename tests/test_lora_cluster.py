"""LoRA adapters served by a real cluster (the tiny model; one prefill, two decode workers; real Ray, Redis, sockets),
every request across the prefill -> decode handoff.

What a user of vLLM's multi-LoRA serving would check: an adapter named by `model` (HTTP and gRPC) gives the greedy
tokens the engine gives alone with that adapter and the model with the adapter merged in (8 requests of the base and
three adapters at once); a prompt cached under one adapter is never hit by another's request; /v1/models lists the
adapters with the base as `parent`; an unknown model is 404 / NOT_FOUND; adapters load and unload at run time behind
the admin key, a bad one refused naming what is wrong while the cluster serves on; a decode worker killed mid-stream,
and the streams (the base and three adapters) still end in their own tokens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import openai
import pytest

from engine.block_hash import hash_prompt_blocks
from router.openai_api import start_http
from router.v1 import inference_pb2 as pb
from tests.helpers import generate_ids, greedy, make_engine, random_prompts, start_test_cluster, wait_for
from tests.lora_adapters import make_adapter, merged_model

pytestmark = pytest.mark.slow
NS = "test-lora"
TOKENS = 8
LONG = 600  # tokens per stream of the kill test: long enough to be killed mid-way
USER, ADMIN = "user-key", "admin-key"


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(str(root / name), tiny, rank=8, seed=seed)
            for name, seed in (("sql", 1), ("chat", 2), ("late", 3), ("math", 4))}


@pytest.fixture(scope="module")
def front(ray_session, adapters):
    def edit(config):
        config.model = "tiny"
        config.decode.replicas, config.decode.max_restarts = 2, 1  # NOTE: a stream fails over to the other one
        config.transfer.transport = "grpc"
        config.lora.modules = {name: adapters[name] for name in ("sql", "chat", "math")}
        config.lora.max_loras = 4  # NOTE: a slot left for the adapter loaded at run time
        config.router.max_predicted_ttft_ms = 600_000  # NOTE: admission is not what this tests (a busy machine)

    # NOTE: every request crosses the handoff: no prefix skip, no SLO rule that has a decode worker prefill
    c, server = start_test_cluster("deploy/local.yaml", NS, edit=edit, port=0, skip_prefill_max_uncached_tokens=0,
                                   slo_itl_ms=None)

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, server.loop).result(60)

    runner, port = on_loop(start_http(server.router, host="127.0.0.1", port=0, model_name="tiny",
                                      api_keys=frozenset({USER}), admin_keys=frozenset({ADMIN})))
    base_url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=USER, max_retries=0, timeout=120)
    yield server, client, base_url, c
    on_loop(runner.cleanup())
    server.close()
    c.stop()


@pytest.fixture(scope="module")
def engine(tiny, adapters):
    """The reference: one engine alone with the same adapters."""
    e = make_engine(tiny, max_loras=4, max_lora_rank=16, num_blocks=256)
    for name, path in adapters.items():
        e.load_lora(name, path)
    return e


def alone(engine, prompt: list[int], lora: str | None) -> list[int]:
    return generate_ids(engine, [prompt], dataclasses.replace(greedy(TOKENS), lora=lora))[0]


def complete(client, model: str, prompt: list[int]) -> tuple[list[int], int, dict]:
    """Greedy token ids, cached prompt tokens and pdcluster's timeline of a completion through the openai client."""
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    assert reply.model == model
    choice = reply.choices[0]
    return (choice.model_extra["token_ids"], reply.usage.prompt_tokens_details.cached_tokens,
            reply.model_extra["pdcluster"]["timeline"])


def post(base_url: str, path: str, body: dict, key: str) -> tuple[int, str]:
    req = urllib.request.Request(base_url + path, json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_models_lists_the_adapters_with_the_base_as_parent(front):
    _, client, _, _ = front
    cards = {m.id: m.model_extra.get("parent") for m in client.models.list().data}
    assert cards["tiny"] is None
    assert cards["sql"] == "tiny" and cards["chat"] == "tiny"


def test_adapter_tokens_through_the_handoff_equal_the_merged_model_in_one_mixed_batch(front, engine, tiny, adapters):
    server, client, _, _ = front
    # NOTE: 8 fresh prompts (no worker caches any), the base model and three adapters, sent at once: the decode
    # workers run them in shared steps, each request across the prefill -> decode handoff
    models = ["tiny", "sql", "chat", "math"] * 2
    prompts = random_prompts(len(models), [21, 40, 7, 33], seed=101)
    with ThreadPoolExecutor(len(models)) as pool:
        results = list(pool.map(lambda job: complete(client, *job), zip(models, prompts)))
    merged = {m: make_engine(merged_model(tiny, adapters[m]), num_blocks=256) for m in ("sql", "chat", "math")}
    for (ids, _, timeline), prompt, model in zip(results, prompts, models):
        assert timeline["prefill_worker"] == "prefill-0" and timeline["decode_worker"].startswith("decode-")
        assert ids == alone(engine, prompt, None if model == "tiny" else model), model
        if model != "tiny":  # NOTE: float32, token-exact: the adapter merged into the base weights says the same
            assert ids == generate_ids(merged[model], [prompt], greedy(TOKENS))[0], model
    # NOTE: the adapters change the tokens (else the test above could not tell them apart)
    assert len({tuple(alone(engine, prompts[0], m)) for m in (None, "sql", "chat", "math")}) == 4
    # gRPC: GenerateRequest.model names the adapter the same way
    prompt = random_prompts(1, [30], seed=102)[0]
    req = pb.GenerateRequest(request_id="lora-grpc-1", prompt_token_ids=prompt, model="chat",
                             sampling=pb.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True))
    ids = [t for chunk in server.stub().GenerateStream(req, timeout=120) for t in chunk.token_ids]
    assert ids == alone(engine, prompt, "chat")


def test_a_prompt_cached_under_one_adapter_is_not_hit_by_another(front, engine):
    server, client, _, _ = front
    prompt = random_prompts(1, [64], seed=103)[0]  # NOTE: 4 full blocks of 16
    first, cached_first, _ = complete(client, "sql", prompt)
    again, cached_again, _ = complete(client, "sql", prompt)
    assert cached_first == 0 and cached_again >= 48 and again == first
    # the prefix index (Redis) holds the blocks under the adapter's key: the router's lookup under another
    # adapter's key (or the base model's) matches nothing, so it never routes to them as a cache hit either
    router = server.router

    def lookup(model: str | None) -> dict[str, int]:
        return router.index.lookup(hash_prompt_blocks(prompt, router.info.block_size, router.info.scope,
                                                      extra_keys=router.adapters.key(model)))

    # NOTE: the workers publish their new blocks every 50 ms (cluster/worker_publisher.py): wait for the sql ones
    wait_for(lambda: bool(lookup("sql")), timeout=10.0)
    matched = {m: lookup(m) for m in ("sql", "chat", None)}
    assert matched["sql"] and not matched["chat"] and not matched[None], matched
    for model in ("chat", "tiny"):
        ids, cached, _ = complete(client, model, prompt)
        assert cached == 0, model
        assert ids == alone(engine, prompt, None if model == "tiny" else model), model


def test_an_unknown_model_is_404_and_grpc_not_found(front):
    server, client, _, _ = front
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-adapter", prompt=[1, 2, 3], max_tokens=2)
    assert "no-such-adapter" in str(e.value)
    req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], model="no-such-adapter",
                             sampling=pb.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as err:
        server.stub().Generate(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_adapters_load_and_unload_at_run_time_behind_the_admin_key(front, engine, adapters, tmp_path):
    _, client, base_url, _ = front
    body = {"lora_name": "late", "lora_path": adapters["late"]}
    assert post(base_url, "/v1/load_lora_adapter", body, USER)[0] == 403
    status, text = post(base_url, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)}, ADMIN)
    assert status == 400 and "adapter_config.json" in text
    assert post(base_url, "/v1/load_lora_adapter", body, ADMIN)[0] == 200
    prompt = random_prompts(1, [19], seed=104)[0]
    assert complete(client, "late", prompt)[0] == alone(engine, prompt, "late")
    assert "late" in {m.id for m in client.models.list().data}
    assert "bad" not in {m.id for m in client.models.list().data}
    assert post(base_url, "/v1/unload_lora_adapter", {"lora_name": "late"}, ADMIN)[0] == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "late", prompt)
    assert post(base_url, "/v1/unload_lora_adapter", {"lora_name": "late"}, ADMIN)[0] == 404


def test_a_decode_worker_killed_mid_stream_finishes_with_the_adapters_tokens(front, engine, ray_session):
    server, _, _, c = front
    models = ["sql", "chat", "math", "tiny"]
    prompts = random_prompts(len(models), [12, 25, 18, 9], seed=105)
    want = [generate_ids(engine, [p], dataclasses.replace(greedy(LONG), lora=None if m == "tiny" else m))[0]
            for p, m in zip(prompts, models)]
    stub, started = server.stub(), threading.Event()
    failovers = server.router.metrics.registry.get_sample_value("pdcluster_failovers_total", {"kind": "decode"}) or 0

    def one(i: int) -> tuple[list[int], Any]:
        req = pb.GenerateRequest(request_id=f"lora-kill-{i}", prompt_token_ids=prompts[i], model=models[i],
                                 sampling=pb.SamplingParams(max_tokens=LONG, temperature=0, ignore_eos=True))
        ids, last = [], None
        for chunk in stub.GenerateStream(req, timeout=300):
            ids += chunk.token_ids
            last = chunk
            if len(ids) >= 4:
                started.set()
        return ids, last
    with ThreadPoolExecutor(len(models)) as pool:
        futures = [pool.submit(one, i) for i in range(len(models))]
        assert started.wait(120)
        running = {name: ray_session.get(c.actors[name].load.remote(), timeout=30).running
                   for name in ("decode-0", "decode-1")}
        victim = max(running, key=running.get)  # type: ignore[arg-type]
        ray_session.kill(ray_session.get_actor(victim, namespace=NS), no_restart=False)
        results = [f.result(timeout=300) for f in futures]
    for (ids, last), expected, model in zip(results, want, models):
        assert last.finish_reason == "length" and ids == expected, model
    moved = server.router.metrics.registry.get_sample_value("pdcluster_failovers_total", {"kind": "decode"})
    assert moved is not None and moved > failovers  # NOTE: streams did move off the killed worker mid-way
