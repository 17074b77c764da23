"""Where a serving benchmark sends its load: pdcluster's gRPC router, or any OpenAI-compatible server over HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdcluster.bench.report import log
from pdcluster.bench.stats import RequestRecord
from pdcluster.bench.workloads import Workload

BACKENDS = ("pdcluster", "openai")


@dataclass(frozen=True)
class Target:
    """One server under load: `backend` "pdcluster" (gRPC HOST:PORT in `addr`) or "openai" (a base URL)."""

    backend: str
    addr: str
    model: str | None = None  # the OpenAI `model`; None: the first of GET /v1/models
    api_key: str | None = None
    # a pdcluster router's gRPC address, to wait until its workers are idle between runs (None: nothing to ask)
    status_addr: str | None = None

    def run(self, w: Workload,
            on_done: Callable[[RequestRecord], None] = lambda r: None) -> tuple[list[RequestRecord], float]:
        """Send `w` (open loop); every request's record, by send time, and the run's seconds."""
        if self.backend == "openai":
            from pdcluster.bench.openai_client import run_workload_openai

            return asyncio.run(run_workload_openai(self.addr, w, on_done, model=self.model, api_key=self.api_key))
        from pdcluster.bench.runner import run_workload

        return asyncio.run(run_workload(self.addr, w, on_done, self.api_key))

    def wait_idle(self, timeout_s: float = 120.0) -> None:
        """Until the cluster runs and queues nothing (a pdcluster router); an OpenAI server is idle once every
        streamed answer has ended, which the open-loop client waits for anyway."""
        addr = self.status_addr or (self.addr if self.backend == "pdcluster" else None)
        if addr is None:
            return
        from pdcluster.bench.runner import cluster_status

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = asyncio.run(cluster_status(addr, self.api_key))
            if st.router_inflight == 0 and all(w.running == 0 and w.waiting == 0 for w in st.workers):
                return
            time.sleep(0.5)
        log("serve", f"the cluster at {addr} was still busy {timeout_s:.0f} s after the run")
