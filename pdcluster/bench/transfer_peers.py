"""The receiving ends of `bench transfer`: a raw TCP sink and a KV receiver, each in a spawned process of its own.

Life of a peer (`Peer` is the bench's handle on it):
1. the process starts, binds a loopback port and sends its address back over a Pipe;
2. cma sink: holds a buffer another process writes into (`process_vm_writev`) and answers what it holds;
   TCP sink: per payload it `recv_into`s a preallocated buffer until full, then acks with one byte;
   KV receiver: per request id the bench sends (once the sender saw DONE) it takes the transfer into its engine,
   CRCs the KV it now holds, frees it, and answers ("done", crc, free blocks) or ("failed", reason);
3. None (or the sender closing the socket) ends it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from engine.loader import LoadedModel
    from kv_transfer import ReceiverEndpoint, Transport

# NOTE: torch's OpenMP threads spin while waiting; on a 2-core machine a spinning peer steals the sender's core.
PEER_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}


class BenchError(RuntimeError):
    """A measurement could not be taken (a failed transfer, a peer that died); the message says which and why."""


Layers = Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer: K and V of the blocks sent, each [n, bs, KVH, D]


def kv_crc(layers: Layers) -> int:
    """CRC32C over K then V of every layer, in layer order (the same bytes on both ends of a transfer)."""
    from kv_transfer import payload

    crc = 0
    for k, v in layers:
        for t in (k, v):
            crc = payload.crc32c(t.contiguous(), crc)
    return crc


def cpu_seconds(pid: int | None = None) -> float | None:
    """CPU time (user + system, all threads) of process `pid` so far; this process's if None; None if unknown."""
    if pid is None:
        return time.process_time()
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class ReceiverPeer(Protocol):
    """What the sender needs of a KV receiver: where it listens, and a way to have a finished transfer freed."""

    @property
    def address(self) -> str: ...

    @property
    def pid(self) -> int | None: ...  # the receiver's own process (None: this one)

    def ask(self, request_id: str, timeout: float = ...) -> Any: ...


def free_transfer(endpoint: ReceiverEndpoint, request_id: str, timeout: float = 10.0) -> tuple[Any, ...]:
    """Take a DONE transfer into the receiver's engine, CRC its KV, and free it: ("done", crc, free blocks)."""
    from engine import SamplingParams
    from kv_transfer import TransferState

    receiver = endpoint.receiver
    state = receiver.wait(request_id, timeout)
    if state is not TransferState.DONE:
        err = receiver.error(request_id)
        return ("failed", f"receiver sees {state.value}: {err.reason if err else 'no error recorded'}")
    # NOTE: max_tokens=2: the prefill already sampled one token, at least one more must be allowed
    receiver.take(request_id, SamplingParams(max_tokens=2, temperature=0.0))
    engine = receiver.engine
    with receiver.engine_lock:
        crc = kv_crc([engine.read_kv_layer(request_id, layer) for layer in range(engine.kv_layout.num_layers)])
        engine.abort_request(request_id)
        free = engine.stats().num_free_blocks
    return ("done", crc, free)


def bench_engine_config(num_blocks: int, max_batched: int, kv_cache_dtype: str = "auto", tp: int = 1) -> Any:
    """The engine settings of both ends of the bench: 1 thread (per rank of a TP `tp` group), no prefix cache (every
    send moves every block)."""
    from engine import EngineConfig

    return EngineConfig(num_blocks=num_blocks, num_threads=1, max_num_seqs=4, max_num_batched_tokens=max_batched,
                        enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tp)


def kv_receiver(conn: Connection, transport: Transport, model: str, num_blocks: int, max_batched: int,
                kv_cache_dtype: str = "auto", tp: int = 1) -> None:
    """Process body: a decode-side engine with a ReceiverEndpoint of `transport`; frees each request it is sent."""
    from engine import LLMEngine
    from engine.loader import load_model
    from kv_transfer import ReceiverEndpoint, TransferConfig

    torch.set_num_threads(1)
    engine = LLMEngine(load_model(model), bench_engine_config(num_blocks, max_batched, kv_cache_dtype, tp))
    endpoint = ReceiverEndpoint(engine, TransferConfig(transport=transport), local_name=f"bench-{os.getpid()}")
    conn.send(endpoint.address)
    try:
        while (request_id := conn.recv()) is not None:
            conn.send(free_transfer(endpoint, request_id))
    finally:
        close_endpoint(endpoint)
        engine.close()  # NOTE: a TP group's followers stop with it


def close_endpoint(endpoint: ReceiverEndpoint) -> None:
    """Close a ReceiverEndpoint and wait until its receiver's reaper thread has ended."""
    endpoint.close()
    # NOTE: close() does not join the reaper thread. Left running, it can drop the last reference to the engine
    # while the interpreter finalizes; freeing tensors from a daemon thread then aborts the process (SIGABRT,
    # "terminate called without an active exception"). So wait for it here.
    for thread in threading.enumerate():
        if thread.name == "kv-receiver-reaper":
            thread.join(5)


def tcp_sink(conn: Connection, nbytes: int) -> None:
    """Process body: accept one connection; per `nbytes` received into a preallocated buffer, ack one byte."""
    server = socket.create_server(("127.0.0.1", 0))
    conn.send(f"127.0.0.1:{server.getsockname()[1]}")
    sock, _ = server.accept()
    view = memoryview(bytearray(nbytes))
    with sock:
        while True:
            got = 0
            while got < nbytes:
                n = sock.recv_into(view[got:], nbytes - got)
                if n == 0:
                    return  # the sender closed: done
                got += n
            sock.sendall(b"k")


def cma_sink(conn: Connection, nbytes: int) -> None:
    """Process body: hold a payload-sized buffer (pages touched) for another process to write into with cma; its
    address is "pid:buffer address". Each message is answered with the buffer's first and last byte."""
    import numpy as np

    buf = np.zeros(nbytes, dtype=np.uint8)
    conn.send(f"{os.getpid()}:{buf.ctypes.data}")
    while conn.recv() is not None:
        conn.send((int(buf[0]), int(buf[-1])))


class Peer:
    """The bench's handle on a peer process: its address, one question at a time, and its end."""

    def __init__(self, name: str, target: Callable[..., None], *args: Any, start_timeout: float = 120.0,
                 daemon: bool = True) -> None:
        """`daemon=False` for a peer with processes of its own (a TP group's followers): `close` still ends it."""
        self.name = name
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=daemon, name=f"bench-{name}")
        saved = {k: os.environ.get(k) for k in PEER_ENV}
        os.environ.update(PEER_ENV)  # the child's environment is the parent's at start()
        try:
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        child.close()
        self.pid: int | None = self.proc.pid
        self.address: str = self._recv(start_timeout, "start")

    def ask(self, msg: object, timeout: float = 60.0) -> Any:
        """Send `msg` to the peer and return its answer."""
        self.conn.send(msg)
        return self._recv(timeout, f"answer {msg!r}")

    def _recv(self, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise BenchError(f"{self.name} peer process exited (code {self.proc.exitcode}) before it could {what}")
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} peer process did not {what} within {timeout:.0f} s")
        return self.conn.recv()

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        self.conn.close()
        if self.proc.exitcode:
            print(f"[bench transfer] note: the {self.name} peer process exited with code {self.proc.exitcode}",
                  file=sys.stderr, flush=True)


class LocalPeer:
    """The `local` transport's receiver: an engine and endpoint in this process, behind Peer's interface."""

    name = "local"
    pid = None

    def __init__(self, loaded: LoadedModel, num_blocks: int, max_batched: int, kv_cache_dtype: str = "auto",
                 tp: int = 1) -> None:
        from engine import LLMEngine
        from kv_transfer import ReceiverEndpoint, TransferConfig

        engine = LLMEngine(loaded, bench_engine_config(num_blocks, max_batched, kv_cache_dtype, tp))
        self.endpoint = ReceiverEndpoint(engine, TransferConfig(transport="local"), local_name="bench-local")
        self.address = self.endpoint.address

    def ask(self, request_id: str, timeout: float = 60.0) -> Any:
        """Free a DONE transfer, as the Peer's process would."""
        return free_transfer(self.endpoint, request_id, timeout)

    def close(self) -> None:
        close_endpoint(self.endpoint)
        self.endpoint.receiver.engine.close()
