"""The faults of `pdcluster bench chaos`, done from outside the cluster the way an operator's tools would.

1. `schedule(minutes)` spreads the six faults over the run's middle 80% (the first 10% warms up, the last 10% lets
   the cluster settle before the leak checks);
2. `FaultRunner` runs them on its own thread, each against real processes found under the `pdcluster serve` child:
   - kill-prefill / kill-decode: SIGKILL of a `ray::PrefillActor` / `ray::DecodeActor` process (Ray restarts it if
     the pool's `max_restarts` allows; the event says whether a new process came up);
   - kill-redis: SIGKILL of the embedded `redis-server` (serve's supervisor restarts it where there is one; the
     event says whether one came back);
   - kill-router: `kill -9` of the extra `pdcluster router`, restarted on the same ports;
   - freeze-worker: SIGSTOP of a decode actor, SIGCONT after `freeze_s`;
   - stall-client: an HTTP stream that reads its first chunk and then nothing (`chaos_traffic.stalled_stream`).
3. Each fault is an `Event` with its time from the start of the run and what was seen.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from pdcluster.bench.report import log

KINDS = ("kill-prefill", "kill-decode", "kill-redis", "kill-router", "freeze-worker", "stall-client")
ACTOR_TITLES = {"kill-prefill": "ray::PrefillActor", "kill-decode": "ray::DecodeActor",
                "freeze-worker": "ray::DecodeActor"}
COME_BACK_S = 60.0  # how long a killed process has to come back before the event says it did not


@dataclass
class Event:
    """One fault as it happened."""

    at_s: float  # seconds from the start of the run
    kind: str  # one of KINDS
    target: str  # what it hit ("pid 1234 ray::DecodeActor", "redis-server pid 99", ...)
    outcome: str = ""  # what was seen after it ("restarted as pid 1240 after 3.1 s", "did not come back", ...)


def schedule(minutes: float, kinds: tuple[str, ...] = KINDS) -> list[tuple[float, str]]:
    """(seconds from the start, kind) for each fault, evenly over the middle 80% of a run of `minutes`."""
    if minutes <= 0:
        raise ValueError(f"--minutes must be > 0, got {minutes}")
    total = minutes * 60
    step = 0.8 * total / len(kinds)
    return [(round(0.1 * total + i * step, 1), kind) for i, kind in enumerate(kinds)]


def processes_under(root_pid: int, match: Callable[[psutil.Process], bool]) -> list[psutil.Process]:
    """Live descendants of `root_pid` that `match` (processes that vanish while looked at are skipped)."""
    found = []
    try:
        children = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for p in children:
        try:
            if p.status() != psutil.STATUS_ZOMBIE and match(p):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _title(p: psutil.Process) -> str:
    cmd = p.cmdline()
    return cmd[0] if cmd else p.name()


def actors(root_pid: int, title: str) -> list[psutil.Process]:
    """The Ray actor processes of one class (`ray::DecodeActor`) under `root_pid`, oldest first."""
    # NOTE: Ray names an actor's process `ray::<Class>` (and `ray::<Class>.<method>` while a call runs)
    procs = processes_under(root_pid, lambda p: _title(p).split(".")[0].split()[0] == title)
    return sorted(procs, key=lambda p: p.create_time())


def redis_servers(root_pid: int) -> list[psutil.Process]:
    return processes_under(root_pid, lambda p: p.name() == "redis-server")


class FaultRunner:
    """Runs `plan` against the cluster under `serve_pid`; `restart_router()` kills and restarts the extra router;
    `stall_client()` starts the stalled stream and returns a description of what became of it later."""

    def __init__(self, plan: list[tuple[float, str]], serve_pid: int, restart_router: Callable[[], str],
                 stall_client: Callable[[], str], freeze_s: float) -> None:
        self.plan, self.serve_pid, self.freeze_s = plan, serve_pid, freeze_s
        self.restart_router, self.stall_client = restart_router, stall_client
        self.events: list[Event] = []
        self.t0 = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="chaos-faults")
        self._watchers: list[threading.Thread] = []  # NOTE: one per kill, so waiting for a come-back delays no fault

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.freeze_s + 10)
        for w in self._watchers:
            w.join(timeout=COME_BACK_S + 5)

    def _run(self) -> None:
        for at_s, kind in self.plan:
            if self._stop.wait(max(0.0, self.t0 + at_s - time.monotonic())):
                return
            event = Event(round(time.monotonic() - self.t0, 1), kind, "")
            self.events.append(event)
            try:
                self._do(event)
            except Exception as e:  # NOTE: a fault that could not be done is reported, the run goes on
                event.outcome = f"could not be done: {type(e).__name__}: {e}"
            if event.outcome:
                log("chaos", f"{event.at_s:7.1f} s  {kind:<14} {event.target}  {event.outcome}")

    def _do(self, event: Event) -> None:
        kind = event.kind
        if kind in ("kill-prefill", "kill-decode"):
            title = ACTOR_TITLES[kind]
            victims = actors(self.serve_pid, title)
            if not victims:
                event.target, event.outcome = title, "no such process found"
                return
            event.target = f"{title} pid {victims[0].pid}"
            os.kill(victims[0].pid, signal.SIGKILL)
            self._watch(event, lambda: [p.pid for p in actors(self.serve_pid, title)], victims[0].pid, len(victims))
        elif kind == "kill-redis":
            victims = redis_servers(self.serve_pid)
            if not victims:
                event.target, event.outcome = "redis-server", "no embedded redis-server found"
                return
            event.target = f"redis-server pid {victims[0].pid}"
            os.kill(victims[0].pid, signal.SIGKILL)
            self._watch(event, lambda: [p.pid for p in redis_servers(self.serve_pid)], victims[0].pid, 1)
        elif kind == "kill-router":
            event.target = "pdcluster router"
            event.outcome = self.restart_router()
        elif kind == "freeze-worker":
            victims = actors(self.serve_pid, ACTOR_TITLES[kind])
            if not victims:
                event.target, event.outcome = ACTOR_TITLES[kind], "no such process found"
                return
            pid = victims[-1].pid
            event.target = f"{ACTOR_TITLES[kind]} pid {pid}"
            os.kill(pid, signal.SIGSTOP)
            self._stop.wait(self.freeze_s)
            os.kill(pid, signal.SIGCONT)
            event.outcome = f"SIGCONT after {self.freeze_s:.0f} s"
        else:
            event.target = "one HTTP stream"
            event.outcome = self.stall_client()

    def _watch(self, event: Event, pids: Callable[[], list[int]], old: int, count: int) -> None:
        """Fill `event.outcome` on a thread of its own: whether `count` processes other than `old` came back."""

        def watch() -> None:
            t = time.monotonic()
            outcome = f"did not come back within {COME_BACK_S:.0f} s"
            while time.monotonic() - t < COME_BACK_S:
                now = [p for p in pids() if p != old]
                if len(now) >= count:
                    outcome = f"back as pid {now[-1]} after {time.monotonic() - t:.1f} s"
                    break
                time.sleep(0.5)
            event.outcome = outcome
            log("chaos", f"{event.at_s:7.1f} s  {event.kind:<14} {event.target}  {event.outcome}")

        w = threading.Thread(target=watch, daemon=True, name=f"chaos-{event.kind}")
        self._watchers.append(w)
        w.start()
