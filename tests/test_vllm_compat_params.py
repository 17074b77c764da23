"""vLLM-compatible requests, settings and metrics without a cluster: request models, env overrides, serve flags.

The same bodies run against a cluster in tests/test_vllm_compat.py; here each rule is checked on its own.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster import tracing
from cluster.messages import WorkerLoad
from cluster.worker_metrics import WorkerMetrics
from engine.errors import InvalidRequestError
from engine.grammar import StructuredOutputSpec
from pdcluster.cli import apply_flags, build_parser
from pdcluster.config import ClusterConfig, ConfigError
from router.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    IgnoredFieldLog,
    ignored_fields,
    parse,
)
from router.openai_params import chat_turns, prompt_of, sampling_fields

# `vllm bench serve`'s bodies (vllm/benchmarks/lib/endpoint_request_func.py), as it sends them
BENCH_COMPLETION = {"model": "smollm2", "prompt": "The capital of France is", "repetition_penalty": 1.0,
                    "max_tokens": 8, "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True}
BENCH_CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
              "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
# What LangChain / LiteLLM / the OpenAI SDK send at their defaults, next to vLLM's extensions at neutral values
CLIENT_DEFAULTS = {"parallel_tool_calls": True, "user": "alice", "top_k": -1, "min_p": 0, "n": 1,
                   "skip_special_tokens": True, "spaces_between_special_tokens": True, "presence_penalty": 0,
                   "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"},
                   "tool_choice": "none", "include_stop_str_in_output": False, "truncate_prompt_tokens": None}


def test_vllm_bench_bodies_parse():
    c = parse(CompletionRequest, BENCH_COMPLETION)
    assert prompt_of(c) == "The capital of France is" and c.stream and c.stream_options.include_usage
    s = sampling_fields(c, c.max_tokens)
    assert (s.max_tokens, s.ignore_eos) == (8, True)
    chat = parse(ChatCompletionRequest, BENCH_CHAT)
    assert [t.content for t in chat_turns(chat.messages)] == ["Hi"] and chat.max_completion_tokens == 8
    assert ignored_fields(c) == ignored_fields(chat) == []


def test_client_defaults_and_neutral_extensions_are_accepted():
    body = {**BENCH_CHAT, **CLIENT_DEFAULTS}
    req = parse(ChatCompletionRequest, body)
    assert sampling_fields(req, 8).top_k == 0  # -1: top-k off, as in vLLM
    assert ignored_fields(req) == []


# Every field refused before issue 28 (it would have changed the answer): now served, carried to the sampler
SERVED_NOW = [
    ("repetition_penalty", 1.2, "repetition_penalty", pytest.approx(1.2)), ("min_p", 0.1, "min_p", pytest.approx(0.1)),
    ("presence_penalty", 0.5, "presence_penalty", 0.5), ("frequency_penalty", -1, "frequency_penalty", -1.0),
    ("logit_bias", {"42": 5}, "logit_bias", {42: 5.0}), ("n", 2, "n", 2), ("echo", True, "echo", True),
    ("logprobs", 0, "logprobs", 0), ("prompt_logprobs", 3, "prompt_logprobs", 3),
    ("response_format", {"type": "json_object"}, "structured", StructuredOutputSpec("json_object")),
    ("guided_json", {"type": "object"}, "structured", StructuredOutputSpec("json", '{"type": "object"}')),
]
# Still not served: a 400 naming the field
STILL_REFUSED = [
    ("best_of", 3), ("suffix", "x"), ("spaces_between_special_tokens", False), ("include_stop_str_in_output", True),
    ("min_tokens", 4), ("use_beam_search", True), ("add_special_tokens", False),
]


@pytest.mark.parametrize("field, value, attr, carried", SERVED_NOW)
def test_a_field_refused_before_is_served_now(field, value, attr, carried):
    req = parse(CompletionRequest, {**BENCH_COMPLETION, field: value})
    assert getattr(sampling_fields(req, 8), attr) == carried


def test_best_of_equal_to_n_changes_nothing_and_is_taken():
    assert sampling_fields(parse(CompletionRequest, {**BENCH_COMPLETION, "n": 2, "best_of": 2}), 8).n == 2


@pytest.mark.parametrize("field, value", STILL_REFUSED)
def test_a_field_that_would_change_the_answer_is_refused_naming_it(field, value):
    with pytest.raises(InvalidRequestError) as e:
        parse(CompletionRequest, {**BENCH_COMPLETION, field: value})
    assert e.value.field == field


def test_chat_logprobs_are_served_and_a_chat_echo_refused():
    req = parse(ChatCompletionRequest, {**BENCH_CHAT, "logprobs": True, "top_logprobs": 2})
    assert sampling_fields(req, 8).logprobs == 2
    # NOTE: tools and tool_choice are served since issue 41 (tests/test_tool_calls.py)
    for field, value in [("add_generation_prompt", False), ("echo", True)]:
        with pytest.raises(InvalidRequestError) as e:
            parse(ChatCompletionRequest, {**BENCH_CHAT, field: value})
        assert e.value.field == field
    with pytest.raises(InvalidRequestError) as e:
        sampling_fields(parse(ChatCompletionRequest, {**BENCH_CHAT, "top_logprobs": 2}), 8)
    assert e.value.field == "top_logprobs"  # needs logprobs: true


@pytest.mark.parametrize("body, param", [
    ({"temperature": "hot"}, "temperature"), ({"max_tokens": 1.5}, "max_tokens"), ({"stream": "yes"}, "stream"),
    ({"stop": [1]}, "stop[0]"), ({"messages": [{"role": 5}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type"),
])
def test_a_known_field_of_the_wrong_type_is_refused_naming_it(body, param):
    with pytest.raises(InvalidRequestError) as e:
        parse(ChatCompletionRequest, {**BENCH_CHAT, **body})
    assert e.value.field == param


def test_unknown_fields_are_ignored_and_warned_once_per_name(caplog):
    caplog.set_level(logging.WARNING, logger="router.openai_models")
    body = {**BENCH_CHAT, "frobnicate": 1, "metadata": {"a": "b"},
            "messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}]}
    req = parse(ChatCompletionRequest, body)
    names = ignored_fields(req)
    assert names == ["frobnicate", "messages.cache_control", "metadata"]
    log = IgnoredFieldLog()
    labels = [log.note(n) for n in names + names]
    assert labels == names + names
    warned = [r.getMessage() for r in caplog.records if "ignoring the request field" in r.getMessage()]
    assert len(warned) == 3 and all(any(n in w for w in warned) for n in names)


def test_ignored_field_labels_are_capped():
    log = IgnoredFieldLog()
    labels = [log.note(f"f{i}") for i in range(300)]
    assert labels[:256] == [f"f{i}" for i in range(256)] and set(labels[256:]) == {"other"}


def test_pdcluster_env_overrides_any_yaml_field(monkeypatch):
    monkeypatch.setenv("PDCLUSTER_ROUTER__PORT", "50052")
    monkeypatch.setenv("PDCLUSTER_PREFILL__REPLICAS", "2")
    monkeypatch.setenv("PDCLUSTER_TRACING__OTLP_ENDPOINT", "http://127.0.0.1:4317")
    monkeypatch.setenv("PDCLUSTER_MODEL", "smollm2")
    monkeypatch.setenv("PDCLUSTER_API_KEY", "sk-not-a-config-field")  # the client's variable: no field, ignored
    cfg = ClusterConfig.from_yaml("deploy/local.yaml")
    assert (cfg.router.port, cfg.prefill.replicas, cfg.decode.replicas) == (50052, 2, 1)
    assert cfg.tracing.otlp_endpoint == "http://127.0.0.1:4317" and cfg.transfer.transport == "nixl"


def test_a_bad_env_override_names_the_variable(monkeypatch):
    monkeypatch.setenv("PDCLUSTER_ROUTER__PORT", "many")
    with pytest.raises(ConfigError, match="router.port.*PDCLUSTER_ROUTER__PORT"):
        ClusterConfig.from_yaml("deploy/local.yaml")
    monkeypatch.setenv("PDCLUSTER_ROUTER__PORT", "1")
    monkeypatch.setenv("PDCLUSTER_ROUTER__PROT", "1")
    with pytest.raises(ConfigError, match="did you mean 'port'"):
        ClusterConfig.from_yaml("deploy/local.yaml")


def test_serve_model_and_flags_override_yaml_and_env(monkeypatch):
    monkeypatch.setenv("PDCLUSTER_HTTP__PORT", "8100")
    args = build_parser().parse_args(["serve", "smollm2", "--prefill-replicas", "2", "--decode-replicas", "3",
                                      "--port", "0", "--http-port", "8080", "--host", "0.0.0.0"])
    cfg = apply_flags(ClusterConfig.from_yaml(args.config), args)
    assert (cfg.model, cfg.prefill.replicas, cfg.decode.replicas) == ("smollm2", 2, 3)
    assert (cfg.router.port, cfg.http.port, cfg.router.host, cfg.http.host) == (0, 8080, "0.0.0.0", "0.0.0.0")
    bad = build_parser().parse_args(["serve", "--decode-replicas", "0"])
    with pytest.raises(ConfigError, match="decode.replicas"):
        apply_flags(ClusterConfig.from_yaml(bad.config), bad)


def test_serve_takes_vllms_lora_flags():
    args = build_parser().parse_args(["serve", "--lora-modules", "sql=/a/sql", "chat=/a/chat", "--max-loras", "4",
                                      "--max-lora-rank", "32"])
    cfg = apply_flags(ClusterConfig.from_yaml(args.config), args)
    assert cfg.lora.modules == {"sql": "/a/sql", "chat": "/a/chat"}
    assert (cfg.lora.slots, cfg.lora.max_lora_rank) == (4, 32)
    too_few = build_parser().parse_args(["serve", "--lora-modules", "a=/x", "b=/y", "--max-loras", "1"])
    with pytest.raises(ConfigError, match="lora.max_loras"):
        apply_flags(ClusterConfig.from_yaml(too_few.config), too_few)
    twice = build_parser().parse_args(["serve", "--lora-modules", "a=/x", "a=/y"])
    with pytest.raises(ConfigError, match="twice"):
        apply_flags(ClusterConfig.from_yaml(twice.config), twice)
    with pytest.raises(SystemExit):  # NOTE: argparse's usage error, naming NAME=PATH
        build_parser().parse_args(["serve", "--lora-modules", "no-path"])


def test_tracing_is_off_by_default_and_costs_nothing():
    assert ClusterConfig().tracing.otlp_endpoint is None and not tracing.enabled()
    with tracing.span("x", "00-" + "1" * 32 + "-" + "2" * 16 + "-01") as s:
        assert s is None
    assert tracing.start("y") is None and tracing.traceparent_of(None) == ""
    assert tracing.record("z", "", 0, 1) == ""


def test_worker_metrics_read_the_heartbeat_load():
    load = WorkerLoad(running=2, waiting=1, reserved=1, num_blocks=100, free_blocks=75, prompt_tokens=64,
                      cached_prompt_tokens=32)
    m = WorkerMetrics("smollm2", lambda: load)
    m.first_token(0.01, 0.2)
    m.generation.inc(5)
    from prometheus_client import generate_latest

    got = {s.name: s.value for fam in text_string_to_metric_families(generate_latest(m.registry).decode())
           for s in fam.samples if s.labels.get("model_name") == "smollm2"}
    assert got["vllm:num_requests_running"] == 2 and got["vllm:num_requests_waiting"] == 2
    assert got["vllm:kv_cache_usage_perc"] == 0.25
    assert (got["vllm:prefix_cache_queries_total"], got["vllm:prefix_cache_hits_total"]) == (64, 32)
    assert got["vllm:generation_tokens_total"] == 5 and got["vllm:time_to_first_token_seconds_count"] == 1


def test_worker_metrics_count_the_engines_steps_and_bench_path_reads_them():
    from pdcluster.bench.cluster_proc import free_port
    from pdcluster.bench.path_clients import thread_ms, worker_steps, worker_threads

    m = WorkerMetrics("tiny", lambda: WorkerLoad())
    port = m.serve("127.0.0.1", free_port())
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert worker_steps(url) == (0.0, 0.0)
        for took in (0.002, 0.003, 0.005):
            m.step.observe(took)
        steps, seconds = worker_steps(url)
        assert steps == 3 and abs(seconds - 0.01) < 1e-9
        # NOTE: each thread's CPU by its Python name: one that computes 0.1 s of its own CPU time shows that much
        before = worker_threads(url)
        assert "MainThread" in before and "busy-for-the-test" not in before
        done = threading.Event()
        busy = threading.Thread(target=_compute_then_wait, args=(0.1, done), name="busy-for-the-test")
        busy.start()
        try:
            deadline = time.monotonic() + 60  # NOTE: a bound for a hang, not a speed check
            while (now := worker_threads(url)).get("busy-for-the-test", 0.0) < 0.1 and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            done.set()
            busy.join()
        assert thread_ms(before, now, 2)["busy-for-the-test"] >= 50.0  # ms per request, over 2 requests
    finally:
        m.close()


def _compute_then_wait(cpu_s: float, done: threading.Event) -> None:
    """Compute until this thread has used `cpu_s` of CPU time (whatever the machine's load), then wait."""
    while time.thread_time() < cpu_s:
        sum(range(1000))
    done.wait(60)
