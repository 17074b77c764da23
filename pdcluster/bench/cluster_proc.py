"""A cluster for a benchmark: `pdcluster serve` in a child process, started from a deploy YAML, stopped after.

The benchmark client runs in the parent and the router in the child, so the client's timing never waits on the
router's GIL. Overrides (routing, ports) go into a copy of the YAML; the original is never changed.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import yaml

from pdcluster.bench.report import log
from pdcluster.config import ClusterConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent


def resolve(path: str) -> pathlib.Path:
    """A deploy YAML by its path, or relative to the repository root (`deploy/local.yaml` from anywhere)."""
    p = pathlib.Path(path)
    return p if p.exists() else ROOT / p


def load(path: str, routing: str | None = None, http: bool = False) -> ClusterConfig:
    """The config of `path` with the benchmark's overrides: any free ports, no metrics front, the OpenAI HTTP front
    only when `http` (on a free port), `routing`."""
    config = ClusterConfig.from_yaml(resolve(path))
    config.router.port = 0
    config.http.enabled = http
    config.http.port = 0
    config.metrics.enabled = False
    if routing:
        config.router.routing = routing  # type: ignore[assignment]
    return config


@contextmanager
def serving(config: ClusterConfig, label: str, start_timeout_s: float = 300.0) -> Iterator[str]:
    """Start `pdcluster serve` on `config` in a child process; yield its gRPC address; stop it (SIGTERM) after."""
    with serving_endpoints(config, label, start_timeout_s) as endpoints:
        yield endpoints["grpc"]


@contextmanager
def serving_endpoints(config: ClusterConfig, label: str, start_timeout_s: float = 300.0) -> Iterator[dict[str, str]]:
    """As `serving`, yielding every endpoint of its ready line ({"grpc": HOST:PORT, "http": HOST:PORT, ...}) and
    the child's "pid"."""
    if any(pool.device == "cpu" for pool in config.pools().values()):
        _kernel_built()  # NOTE: the CPU attention kernel; GPU pools never load it (a GPU image may lack a compiler)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="pdc-bench-", delete=False) as f:
        yaml.safe_dump(config.model_dump(mode="json"), f, sort_keys=False)
    # NOTE: the workers' nice value is serve's own (0 in its private Ray, as vLLM's processes run: pdcluster/launch.py);
    # a RAY_worker_niceness in this environment reaches it and wins
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               RAY_USAGE_STATS_ENABLED="0")
    launched = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "pdcluster", "serve", "--config", f.name], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tail: list[str] = []
    threading.Thread(target=_drain, args=(proc.stderr, tail), daemon=True).start()
    try:
        endpoints = _wait_ready(proc, start_timeout_s, tail)
        endpoints["pid"], endpoints["start_s"] = str(proc.pid), f"{time.monotonic() - launched:.1f}"
        log("serve", f"{label}: cluster up at {endpoints['grpc']} in {endpoints['start_s']} s ({config.mode}, "
                     f"routing {config.router.routing})")
        yield endpoints
    except BaseException:
        # NOTE: a benchmark that failed mid-run (a client error, a cut connection): what the cluster said last
        log("serve", f"{label}: the run failed; the cluster's last log lines:\n" + "".join(tail[-20:]))
        raise
    finally:
        _stop(proc)
        os.unlink(f.name)


def free_port(n: int = 1) -> int:
    """A port of 127.0.0.1 free now, with the `n - 1` after it free too (a base port, as `metrics.worker_port`)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port + n - 1 <= 65535 and all(_bindable(port + i) for i in range(1, n)):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _kernel_built() -> None:
    """Build the engine's attention kernel if this checkout has not (scripts/install.sh does): a benchmark measures
    the engine users install, not its pure-torch fallback (PDCLUSTER_ATTENTION=gather still picks that)."""
    from engine import kernels

    if kernels.backend_choice() != "gather" and not (kernels.BUILD_DIR / f"{kernels.module_name()}.so").exists():
        log("serve", "building the attention kernel (once, ~1 min): python -m engine.kernels build")
        kernels.build()


def _drain(stream: object, tail: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        tail.append(line)
        del tail[:-40]


def _wait_ready(proc: subprocess.Popen[str], timeout_s: float, tail: list[str]) -> dict[str, str]:
    assert proc.stdout is not None
    # NOTE: a child that hangs without printing would block the read below forever; stopping it ends the read.
    timer = threading.Timer(timeout_s, _stop, args=(proc,))
    timer.start()
    try:
        for line in proc.stdout:
            if line.startswith("pdcluster ready:"):
                fields = dict(kv.split("=", 1) for kv in line.split()[2:])
                threading.Thread(target=_drain, args=(proc.stdout, []), daemon=True).start()
                return fields
    finally:
        timer.cancel()
    _stop(proc)
    raise RuntimeError(f"the benchmark cluster did not start (or not within {timeout_s:.0f} s):\n"
                       + "".join(tail[-20:]))


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
