"""The extra `pdcluster router` of `pdcluster bench chaos`, and the end-of-run reads of the routers and workers.

The router is a child process started as the README says (`pdcluster router --config Y --ray R --redis H:P`), on
ports fixed when the bench starts (written into a copy of the YAML), so a restart after `kill -9` takes the same
addresses and the clients keep calling them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import psutil
import yaml

from pdcluster.bench.cluster_proc import ROOT, free_port
from pdcluster.bench.report import log
from pdcluster.config import ClusterConfig
from router.v1 import inference_pb2 as pb

START_TIMEOUT_S = 180.0



class ExtraRouter:
    """One `pdcluster router` attached to serve's Ray and Redis; `restart()` is the chaos fault."""

    def __init__(self, config: ClusterConfig, ep: dict[str, str]) -> None:
        cfg = config.model_copy(deep=True)
        cfg.router.port, cfg.http.port, cfg.metrics.port = free_port(), free_port(), free_port()
        cfg.http.enabled = cfg.metrics.enabled = True
        self.grpc = f"{cfg.router.host}:{cfg.router.port}"
        self.http = f"{cfg.http.host}:{cfg.http.port}"
        self.metrics = f"{cfg.metrics.host}:{cfg.metrics.port}"
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="pdc-chaos-router-", delete=False) as f:
            yaml.safe_dump(cfg.model_dump(mode="json"), f, sort_keys=False)
        self.yaml = f.name
        self.argv = [sys.executable, "-m", "pdcluster", "router", "--config", self.yaml, "--redis", ep["redis"]]
        if "ray" in ep:
            self.argv += ["--ray", ep["ray"]]
        self.starts = 0
        self.ready_pid = -1  # the process once it has printed its ready line (its memory is sampled from then on)
        self.proc: subprocess.Popen[str] | None = None
        self._start()

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   RAY_USAGE_STATS_ENABLED="0")
        self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        self.starts += 1
        ready = threading.Event()

        def read(stream: Any) -> None:
            for line in stream:
                if line.startswith("pdcluster ready:"):
                    ready.set()

        threading.Thread(target=read, args=(self.proc.stdout,), daemon=True).start()
        if not ready.wait(START_TIMEOUT_S):
            raise RuntimeError(f"the extra router did not start within {START_TIMEOUT_S:.0f} s: {self.argv}")
        self.ready_pid = self.proc.pid
        log("chaos", f"extra router #{self.starts} up at {self.grpc} (pid {self.proc.pid})")

    def restart(self) -> str:
        """kill -9 the router, start it again on the same ports; what happened."""
        assert self.proc is not None
        old = self.proc.pid
        os.kill(old, signal.SIGKILL)
        self.proc.wait()
        t = time.monotonic()
        try:
            self._start()
        except RuntimeError as e:
            return f"pid {old} killed; {e}"
        return f"pid {old} killed; restarted as pid {self.pid}, ready after {time.monotonic() - t:.1f} s"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if os.path.exists(self.yaml):
            os.unlink(self.yaml)

    @staticmethod
    def rss_mb(pid: int) -> float | None:
        try:
            return round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            return None


def inflight(metrics_addr: str | None) -> float | None:
    """The router's `pdcluster_router_inflight_requests` gauge from its /metrics (None: unreachable)."""
    return metric(metrics_addr, "pdcluster_router_inflight_requests")


def metric(metrics_addr: str | None, name: str) -> float | None:
    """One unlabelled sample of the router's /metrics (None: unreachable or absent)."""
    if not metrics_addr:
        return None
    try:
        with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def wait_idle(stub: Any, timeout_s: float = 60.0) -> pb.ClusterStatus | None:
    """The cluster status once every live worker is idle with all blocks free, or the last one seen at the timeout
    (None when serve never answered)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = stub.GetClusterStatus(pb.ClusterStatusRequest(), timeout=10)
        except Exception:  # NOTE: serve may be busy re-attaching; keep asking until the deadline
            time.sleep(1.0)
            continue
        if all(w.running == 0 and w.free_blocks == w.num_blocks for w in last.workers if w.alive):
            return last
        time.sleep(1.0)
    return last
