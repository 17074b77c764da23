"""Faults for `pdcluster bench soak`: mid-soak, one decode worker killed without restart, another one hung.

The kill is Ray's (`ray.kill(..., no_restart=True)`: the process is gone for good); the hang is the workers'
fault-injection method `debug_hang(seconds)`, which holds the real engine loop. Both need the cluster the soak
started itself (its Ray is this process's). What the soak then checks:
- no request lost or duplicated (the soak's own token counts);
- after the heartbeat TTL, no request routed to either: no request that started later ends on a faulted worker
  while it is faulted, and the router's decode failovers stop once the streams that were on them moved (a request
  sent to the dead worker would fail over; one sent to the hung worker would wait there for the hang to end).
"""

from __future__ import annotations

import argparse
import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from cluster.prefix_index import HEARTBEAT_TTL_S
from pdcluster.bench.report import log

SETTLE_MARGIN_S = 5.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decode-replicas", type=int, default=None, help="decode workers (default: the YAML's)")
    p.add_argument("--kill-at", type=float, default=None, help="minute at which a decode worker is killed for good")
    p.add_argument("--kill-worker", default="decode-0")
    p.add_argument("--hang-at", type=float, default=None, help="minute at which a decode worker's engine hangs")
    p.add_argument("--hang-s", type=float, default=60.0, help="how long it hangs")
    p.add_argument("--hang-worker", default="decode-1")


@dataclass
class Fault:
    kind: str  # "kill" | "hang"
    worker: str
    at: float  # monotonic
    until: float  # monotonic; inf for a kill


@dataclass
class Faults:
    """Runs the planned faults on their own thread and samples the router's decode failover count."""

    args: argparse.Namespace
    namespace: str
    metrics_url: str
    stall_min_s: float
    t0: float = 0.0
    done: list[Fault] = field(default_factory=list)
    failovers: list[tuple[float, float]] = field(default_factory=list)  # (monotonic, pdcluster_failovers decode)
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def planned(self) -> bool:
        return self.args.kill_at is not None or self.args.hang_at is not None

    def start(self, t0: float) -> None:
        self.t0 = t0
        threading.Thread(target=self._run, daemon=True, name="soak-faults").start()
        threading.Thread(target=self._sample, daemon=True, name="soak-failovers").start()

    def stop(self) -> None:
        self._sample_once()
        self._stop.set()

    def _run(self) -> None:
        import ray

        plan = sorted([(self.args.kill_at, "kill"), (self.args.hang_at, "hang")], key=lambda p: p[0] or 0.0)
        for minute, kind in plan:
            if minute is None:
                continue
            if self._stop.wait(max(0.0, self.t0 + minute * 60 - time.monotonic())):
                return
            worker = self.args.kill_worker if kind == "kill" else self.args.hang_worker
            actor = ray.get_actor(worker, namespace=self.namespace)
            now = time.monotonic()
            if kind == "kill":
                ray.kill(actor, no_restart=True)
                self.done.append(Fault(kind, worker, now, float("inf")))
            else:
                ray.get(actor.debug_hang.remote(self.args.hang_s), timeout=60)
                self.done.append(Fault(kind, worker, now, now + self.args.hang_s))
            log("soak", f"{(now - self.t0) / 60:.1f} min: {kind} {worker}")

    def _sample(self) -> None:
        while not self._stop.wait(1.0):
            self._sample_once()

    def _sample_once(self) -> None:
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError:
            return
        m = re.search(r'^pdcluster_failovers_total\{kind="decode"\} (\S+)$', text, re.M)
        self.failovers.append((time.monotonic(), float(m.group(1)) if m else 0.0))

    def figures(self, served: list[tuple[float, str]]) -> dict[str, Any]:
        """`served`: (start, final decode worker) of every finished request."""
        late = [(start, worker) for start, worker in served for f in self.done
                if worker == f.worker and f.at + HEARTBEAT_TTL_S <= start < f.until]
        # NOTE: streams on a hung worker move once the router's stall timeout passes; after that, and the TTL,
        # a decode failover means a request was sent to a faulted worker
        settle = max((f.at + HEARTBEAT_TTL_S + (self.stall_min_s if f.kind == "hang" else 0.0) + SETTLE_MARGIN_S
                      for f in self.done), default=None)
        total = self.failovers[-1][1] if self.failovers else 0.0
        before = max((v for t, v in self.failovers if settle is not None and t <= settle), default=0.0)
        return {"faults": [{"kind": f.kind, "worker": f.worker, "at_min": round((f.at - self.t0) / 60, 2),
                            "seconds": None if f.kind == "kill" else self.args.hang_s} for f in self.done],
                "requests_on_faulted_worker_after_ttl": len(late),
                "decode_failovers": int(total),
                "decode_failovers_after_settle": int(total - before) if settle is not None else None}
