"""`pdcluster serve` as an operator runs it: a separate process, the ready line, gRPC traffic, SIGTERM, no leftovers."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import psutil
import pytest

from router.v1 import inference_pb2 as pb
from router.v1 import inference_pb2_grpc as pb_grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow


def start_serve(*args: str, command: str = "serve") -> tuple[subprocess.Popen[str], dict[str, str]]:
    env = dict(os.environ, PYTHONPATH=REPO, RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen([sys.executable, "-m", "pdcluster", command, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("pdcluster ready: "):
            fields = dict(f.split("=", 1) for f in line.split(": ", 1)[1].split())
            return proc, fields
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"serve did not get ready: {proc.stderr.read() if proc.stderr else ''}")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdcluster", *args], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=120)


def test_serve_answers_grpc_and_leaves_nothing_behind_after_sigterm():
    proc, endpoints = start_serve("--config", "deploy/local.yaml", "--port", "0", "--http-port", "0",
                                  "--metrics-port", "0")
    addr = endpoints["grpc"]
    try:
        # NOTE: the router's grammar library (xgrammar, with torch) is loaded by the time serve says it is ready:
        # imported later, it held the GIL while the first requests went through the router
        if sys.platform == "linux":
            maps = pathlib.Path(f"/proc/{proc.pid}/maps").read_text()
            assert "libxgrammar_bindings" in maps and "libtorch" in maps
        family = psutil.Process(proc.pid).children(recursive=True)
        names = {p.name() for p in family}
        assert any("redis-server" in n for n in names), names  # the embedded Redis
        assert any(n in ("raylet", "gcs_server") for n in names), names  # the private Ray
        stub = pb_grpc.InferenceStub(grpc.insecure_channel(addr))
        r = stub.Generate(pb.GenerateRequest(prompt="The capital of France is",
                                             sampling=pb.SamplingParams(max_tokens=8, temperature=0)), timeout=120)
        assert r.usage.completion_tokens == len(r.token_ids) > 0 and r.timeline.decode_worker == "decode-0"
        health = urllib.request.urlopen(f"http://{endpoints['http']}/health", timeout=10).read()
        assert json.loads(health) == {"status": "ok"}
        scrape = urllib.request.urlopen(f"http://{endpoints['metrics']}/metrics", timeout=10).read().decode()
        assert 'pdcluster_requests_total{api="grpc",status="OK"} 1.0' in scrape  # the Generate above
        from openai import OpenAI  # the official client, streaming a chat completion from `serve`

        oa = OpenAI(base_url=f"http://{endpoints['http']}/v1", api_key="unused")
        stream = oa.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
        pieces = list(stream)
        assert "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
        assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens > 0
        # tool calling on the shipped config, as it stands (its template and parser; tests/test_tool_calls_cluster.py
        # has the 20 of 20): a forced call validates against its schema, unary and streamed; a bad input is a 400
        import jsonschema
        from openai import BadRequestError

        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
        ask = {"model": "smollm2", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": tools,
               "max_tokens": 60, "temperature": 0}
        called = oa.chat.completions.create(tool_choice="required", **ask).choices[0]  # type: ignore[arg-type]
        assert called.finish_reason == "tool_calls" and called.message.tool_calls
        jsonschema.validate(json.loads(called.message.tool_calls[0].function.arguments), schema)
        named = {"type": "function", "function": {"name": "get_weather"}}
        deltas = [c.choices[0] for c in oa.chat.completions.create(tool_choice=named, stream=True, **ask) if c.choices]
        assert deltas[-1].finish_reason == "tool_calls"
        arguments = "".join(t.function.arguments or "" for c in deltas for t in c.delta.tool_calls or [])
        jsonschema.validate(json.loads(arguments), schema)
        with pytest.raises(BadRequestError) as refused:
            oa.chat.completions.create(tool_choice={"type": "function", "function": {"name": "nope"}}, **ask)
        assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]
        status = cli("status", "--addr", addr)
        assert status.returncode == 0 and "prefill-0" in status.stdout and "decode-0" in status.stdout
        gen = cli("generate", "--addr", addr, "--json", "--max-tokens", "8", "The capital of France is")
        assert gen.returncode == 0, gen.stderr
        assert json.loads(gen.stdout)["token_ids"] == list(r.token_ids)
        streamed = cli("generate", "--addr", addr, "--stream", "--max-tokens", "8", "The capital of France is")
        assert streamed.returncode == 0 and streamed.stdout.strip() == r.text.strip()
        assert "prefill=prefill-0 decode=decode-0" in streamed.stderr or "decode=decode-0" in streamed.stderr
        chat = cli("chat", "--addr", addr, "--max-tokens", "8", "Name a colour.")
        assert chat.returncode == 0 and chat.stdout.strip() and "generated]" in chat.stderr
        bad = cli("generate", "--addr", addr, "--max-tokens", "0", "Hi")
        assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr and "sampling.max_tokens" in bad.stderr
        # a second router process joins through Ray and the embedded Redis, and serves the same workers
        second, second_endpoints = start_serve("--ray", endpoints["ray"], "--redis", endpoints["redis"], "--port", "0",
                                              command="router")
        try:
            r2 = pb_grpc.InferenceStub(grpc.insecure_channel(second_endpoints["grpc"])).Generate(
                pb.GenerateRequest(prompt="The capital of France is",
                                   sampling=pb.SamplingParams(max_tokens=8, temperature=0)), timeout=120)
            assert list(r2.token_ids) == list(r.token_ids) and r2.timeline.decode_worker == "decode-0"
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(timeout=60) == 0
        again = stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(
            max_tokens=2, ignore_eos=True)), timeout=60)
        assert again.usage.completion_tokens == 2  # the extra router's exit left the cluster serving
        family = psutil.Process(proc.pid).children(recursive=True)  # the workers exist by now too
        actors = {role: next(p for p in family if f"{role}Actor" in " ".join(p.cmdline()))
                  for role in ("Prefill", "Decode")}
        if "RAY_worker_niceness" not in os.environ:  # NOTE: the engines run at the router's priority, not Ray's 15
            assert [a.nice() for a in actors.values()] == [psutil.Process(proc.pid).nice()] * 2
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= 2:  # NOTE: deploy/local.yaml's cpu_affinity auto (pdcluster/core_plan.py)
            assert actors["Decode"].cpu_affinity() == cores[-1:] and actors["Prefill"].cpu_affinity() == cores[-2:-1]
            assert psutil.Process(proc.pid).cpu_affinity() == cores[:-1]  # the router keeps off the decode core
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        # NOTE: the router ran on uvloop (router.event_loop auto, uvloop installed with pdcluster), SIGTERM included
        assert proc.stderr is not None and "router event loop: uvloop (router.event_loop: auto)" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    gone, alive = psutil.wait_procs(family, timeout=15)
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_serve_rejects_bad_yaml_naming_the_field_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: smollm2\nprefill:\n  replicas: -1\n")
    proc = subprocess.run([sys.executable, "-m", "pdcluster", "serve", "--config", str(bad)], cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "bad.yaml:3" in proc.stderr and "prefill.replicas" in proc.stderr
