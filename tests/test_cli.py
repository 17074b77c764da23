"""The `pdcluster` command line, run as a user runs it: a separate process, its stdout, stderr and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import engine
from tests.helpers import greedy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pdcluster(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-m", "pdcluster", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_llm() -> engine.LLM:
    return engine.LLM("tiny", num_blocks=64, num_threads=2)


@pytest.mark.parametrize("argv", [["generate", "--addr", "127.0.0.1:1", "Hi"], ["status", "--addr", "127.0.0.1:1"],
                                  ["chat", "--addr", "127.0.0.1:1", "Hi"]])
def test_a_client_command_loads_neither_torch_nor_the_engine(argv):
    """A client of a running cluster only dials it: no bench module, planner or engine (torch) on its way."""
    code = ("import sys; from pdcluster.cli import main; code = main(sys.argv[1:]); "
            "print(sorted(m for m in ('torch', 'engine', 'ray') if m in sys.modules)); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "UNAVAILABLE" in proc.stderr, proc.stderr  # nothing listens there
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


def test_the_router_process_imports_without_torch():
    """`serve` and `router` run no model: their modules, and the actor classes they start workers from, import with
    torch made unimportable (the workers import the engine in their own processes; the grammar library, which pulls
    torch in, is imported on a thread of its own while the workers start: engine.grammar.preload)."""
    code = ("import sys; sys.modules['torch'] = None; import pdcluster.serve, pdcluster.launch, router.service, "
            "router.openai_api, decode_workers.actor, prefill_workers.actor, kv_transfer.transports as t; "
            "print(t.unavailable('nixl'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "None", proc.stdout  # NOTE: NIXL is installed here, and found without torch


def test_the_grammar_library_is_imported_on_a_thread_of_its_own():
    """`serve` imports xgrammar (the router's grammar checks) on a thread while the workers start, not at the first
    request with tools."""
    code = ("import sys; from engine import grammar; assert 'xgrammar' not in sys.modules; "
            "t = grammar.preload(); t.join(120); print(t.name, 'xgrammar' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.split() == ["xgrammar-import", "True"], proc.stderr[-2000:]


def test_output_piped_into_a_reader_that_left_ends_without_a_traceback():
    """`pdcluster ... | head`: the reader is gone before the write; the command ends with status 1 and says nothing."""
    read, write = os.pipe()
    os.close(read)  # NOTE: the reader left before the first byte
    proc = subprocess.run([sys.executable, "-m", "pdcluster", "serve", "--check", "--config", "deploy/local.yaml"],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), stdout=write, stderr=subprocess.PIPE,
                          text=True, timeout=60)
    os.close(write)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("prompts", [["Hello"], ["Hello", "The capital of France is"]], ids=["one", "two"])
def test_generate_json_prints_one_line_per_prompt_with_the_engines_tokens(tiny_llm, prompts):
    proc = pdcluster("generate", "--local", "--model", "tiny", "--json", "--max-tokens", "5", "--ignore-eos", *prompts)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(prompts), proc.stdout
    expected = tiny_llm.generate(prompts, greedy(5))
    for line, prompt, want in zip(lines, prompts, expected):
        got = json.loads(line)
        assert got["prompt"] == prompt
        assert got["token_ids"] == want.token_ids and len(got["token_ids"]) == 5
        assert got["text"] == want.text
        assert got["finish_reason"] == "length"
        assert got["prompt_tokens"] == len(want.prompt_token_ids)


def test_generate_with_zero_max_tokens_exits_2_naming_the_field():
    proc = pdcluster("generate", "--local", "--model", "tiny", "--max-tokens", "0", "Hello")
    assert proc.returncode == 2
    assert "max_tokens" in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"]], ids=["top", "generate"])
def test_help_exits_0_and_names_the_commands(args):
    proc = pdcluster(*args)
    assert proc.returncode == 0, proc.stderr
    assert "generate" in proc.stdout
    if args == ["--help"]:
        assert "bench" in proc.stdout
    else:
        assert "--max-tokens" in proc.stdout and "--local" in proc.stdout


@pytest.mark.parametrize("module", ["pdcluster", "pdcluster.cli"])
def test_both_module_forms_run_the_command_line(module):
    """`python -m pdcluster.cli serve` did nothing and exited 0 (issue 38): both forms run the same parser."""
    proc = subprocess.run([sys.executable, "-m", module, "serve", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:") and "--config" in proc.stdout


def test_bench_transfer_prints_one_json_object_with_every_transport(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, "-m", "pdcluster", "bench", "transfer", "--model", "tiny", "--tokens", "256",
                           "--repeat", "1", "--overlap-repeat", "1", "--idle-s", "0.2", "--json", "--out", str(out),
                           "--transports", "grpc,torch,local,nixl,nixl-tcp"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = json.loads(proc.stdout)
    assert figures == json.loads(out.read_text())
    assert figures["references"]["tcp"]["best_gb_s"] > 0 and figures["references"]["memcpy"]["best_gb_s"] > 0
    assert figures["references"]["cma"]["best_gb_s"] > 0  # Linux: the sink is this bench's child
    for name in ("grpc", "torch", "local", "nixl", "nixl-tcp"):
        assert figures["transports"][name]["best_gb_s"] > 0
    assert set(figures["overlap"]) == {"grpc", "torch", "nixl"}
    assert figures["transports"]["nixl"]["idle_core_pct"] is not None


def test_serve_check_refuses_a_bad_config_naming_the_field_and_starts_nothing(tmp_path):
    bad = tmp_path / "tp3.yaml"
    bad.write_text("model: tiny\nprefill:\n  tensor_parallel_size: 3\n")
    proc = pdcluster("serve", "--check", "--config", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"{bad}:3: prefill.tensor_parallel_size: 3 must divide the model's 4 attention heads" in proc.stderr
    ok = pdcluster("serve", "--check", "--config", "deploy/local.yaml", "--decode-replicas", "2")
    assert ok.returncode == 0 and "decode: 2 x (cpu; each reserves 1 CPU, 0 GPU)" in ok.stdout
