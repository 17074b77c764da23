"""One rank's view of a tensor-parallel group: its process groups, the step channel and the all-reduce.

NOTE: the process groups are standalone objects over a TCPStore (torch.distributed's ProcessGroupGloo /
ProcessGroupNCCL), not torch.distributed's global default group: a process may hold several groups (tests, a
bench comparing sizes) and nothing global has to be torn down between them. Two groups per rank, as vLLM keeps
them: the device group (NCCL on CUDA, gloo on the CPU) all-reduces activations (on the CPU through shared memory
instead when they fit: shm_allreduce.py); a gloo group on the CPU carries the step messages from rank 0 where the
followers' pipes (step_channel.py) cannot, so a step's control never goes through (and never syncs) the GPU. A
third, gloo on the CPU, carries the KV hand-off's reads and writes (engine/parallel/kv.py), which run beside the
steps.
"""

from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.linear import Int8Linear, PackedLinear
from engine.parallel.shard import vocab_rows
from engine.parallel.shm_allreduce import ShmAllReduce
from engine.parallel.shm_allreduce import wanted as shm_wanted
from engine.parallel.step_channel import StepChannel
from engine.parallel.step_channel import wanted as pipes_wanted

# NOTE: a bound on every collective of a step: a peer that hangs without closing its sockets (a stopped process)
# fails the group after this long instead of blocking it forever; a dead one (closed sockets) fails it at once.
# Between steps a follower waits for the next one up to IDLE_TIMEOUT: an engine may idle for hours.
DEFAULT_TIMEOUT_S = 120.0
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a follower's wait for rank 0's next step
MESSAGE_BYTES = 16384  # a step message up to this size (its length included) takes one broadcast


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks of one group meet: rank 0 serves a TCPStore at host:port."""

    host: str
    port: int
    size: int
    timeout_s: float = DEFAULT_TIMEOUT_S


@dataclass
class CollectiveStats:
    """Wall time this rank spent in the all-reduces of row-parallel layers, or in the logits' gathers (waiting for
    slower ranks included).

    NOTE: on the CPU (gloo) the call returns when the sum is done: this is the all-reduce's time. On CUDA (NCCL) it
    returns once the all-reduce is queued on the stream: the figure is then launch time, not GPU time.
    """

    calls: int = 0
    seconds: float = 0.0


def serve_store(size: int, host: str = "127.0.0.1",
                timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[dist.TCPStore, Rendezvous]:
    """Rank 0's TCPStore on a free port (the OS picks it: no race for a port) and the rendezvous naming it."""
    store = dist.TCPStore(host, 0, size, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, Rendezvous(host, store.port, size, timeout_s)


class TPGroup:
    """This rank's membership of a TP group: `all_reduce` (device group), `broadcast_object` (CPU group), and
    the KV hand-off's group (`kv`, gloo on the CPU)."""

    def __init__(self, rank: int, rdv: Rendezvous, device: torch.device, store: dist.TCPStore | None = None) -> None:
        timeout = datetime.timedelta(seconds=rdv.timeout_s)
        self.rank, self.size, self.device, self.timeout_s = rank, rdv.size, device, rdv.timeout_s
        # NOTE: rank 0 passes the store it serves (`serve_store`); the others connect to it
        self.store = store or dist.TCPStore(rdv.host, rdv.port, rdv.size, False, timeout=timeout)
        # NOTE: typed Any: torch's stubs lack the backends' (store, rank, size, timeout) constructors and methods
        gloo: Any = dist.ProcessGroupGloo
        self.cpu: Any = gloo(dist.PrefixStore("cpu/", self.store), rank, rdv.size, timeout)
        # NOTE: the KV hand-off's own group (engine/parallel/kv.py): its reads and writes run beside the steps (from
        # inside a forward, or from a receiver thread) and must never interleave with the step channel's collectives
        self.kv: Any = gloo(dist.PrefixStore("kv/", self.store), rank, rdv.size, timeout)
        if device.type == "cuda":
            # NOTE: absent from CPU builds of torch (this machine)
            nccl: Any = dist.ProcessGroupNCCL  # type: ignore[attr-defined, unused-ignore]
            self.dev: Any = nccl(dist.PrefixStore("dev/", self.store), rank, rdv.size)
        else:
            self.dev = gloo(dist.PrefixStore("dev/", self.store), rank, rdv.size, timeout)
        # NOTE: after the gloo groups, whose constructors wait for every rank: the shared memory's rendezvous then
        # finds them all there
        self.shm = ShmAllReduce.join(rank, rdv.size, self.store, rdv.timeout_s) if shm_wanted(device) else None
        # NOTE: the step messages through a pipe per follower where it can (engine/parallel/step_channel.py), else on
        # the CPU group
        self.steps = StepChannel.join(rank, rdv.size, self.store, rdv.timeout_s) if pipes_wanted() else None
        # NOTE: and the KV hand-off's requests to the followers' KV threads (engine/parallel/kv.py), on pipes of their
        # own (its data goes over the `kv` group)
        self.kv_requests = (StepChannel.join(rank, rdv.size, self.store, rdv.timeout_s, name="kv")
                            if pipes_wanted() else None)
        self.stats = CollectiveStats()
        self.gathers = CollectiveStats()  # the LM head's logits gathered on rank 0 (`gather_columns`), one per step

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place (every rank ends with the same values): through shared memory on the
        CPU (engine/parallel/shm_allreduce.py) when it fits a slot, else on the device group."""
        start = time.perf_counter()
        if self.shm is not None and self.shm.fits(t):
            self.shm.all_reduce(t)
        else:
            self.dev.allreduce([t]).wait()
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1

    def gather_columns(self, part: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank 0: every rank's `part` ([N, widths[r]], rank order) side by side, [N, sum(widths)]; the others:
        None (a collective: every rank calls it with its part).

        NOTE: the parts travel padded to the widest (the last rank's may be narrower), so every rank sends the same
        shape: through shared memory on the CPU when that fits a slot, else a gather on the device group."""
        start = time.perf_counter()
        width = max(widths)
        if part.shape[1] < width:
            part = torch.nn.functional.pad(part, (0, width - part.shape[1]))
        part = part.contiguous()
        if self.shm is not None and self.shm.fits(part):
            parts = self.shm.gather(part)
        else:
            parts = [torch.empty_like(part) for _ in range(self.size)] if self.rank == 0 else None
            opts = dist.GatherOptions()
            opts.rootRank = 0
            self.dev.gather([parts] if parts is not None else [], [part], opts).wait()
        out = None if parts is None else torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)
        self.gathers.seconds += time.perf_counter() - start
        self.gathers.calls += 1
        return out

    def broadcast_object(self, obj: object = None) -> Any:
        """Rank 0's `obj` on every rank (rank 0 passes it, the others get it), pickled, on the step channel: the
        followers' pipes, or the CPU group's broadcast."""
        return self._from_rank_0(self.steps, self.cpu, obj)

    def kv_request(self, obj: object = None) -> Any:
        """Rank 0's KV request (`obj`) on every rank, as `broadcast_object` does for steps: the KV threads' pipes,
        or the `kv` group's broadcast."""
        return self._from_rank_0(self.kv_requests, self.kv, obj)

    def _from_rank_0(self, pipes: StepChannel | None, pg: Any, obj: object) -> Any:
        if pipes is None:
            return broadcast_object(pg, self.rank, obj)
        if self.rank:
            return pipes.recv()
        pipes.send(obj)
        return obj

    def close(self) -> None:
        """Let the shared memory and the pipes go (the process groups go with the object)."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        for channel in (self.steps, self.kv_requests):
            if channel is not None:
                channel.close()
        self.steps = self.kv_requests = None

    def min(self, value: int) -> int:
        """The smallest of the ranks' `value`s, on every rank (a collective of the step channel: all ranks call it)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]  # NOTE: torch's stubs type it RedOpType
        self.cpu.allreduce([t], opts).wait()
        return int(t.item())


def broadcast_object(pg: Any, rank: int, obj: object = None) -> Any:
    """Rank 0's `obj` on every rank of the gloo group `pg` (rank 0 passes it, the others get it), pickled.

    NOTE: one collective for a message of up to MESSAGE_BYTES (a step's message, as a rule: decode steps take a
    few hundred bytes, a 512-token prompt ~3 KB): a fixed buffer whose first 8 bytes hold the length; a longer
    message sends its rest in a second one. Each gloo collective costs ~0.2 ms here (a thread hand-off on
    each rank), so the usual length-then-bytes pair would double a step's control cost.
    """
    buf = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8)
    if rank == 0:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        head = len(data).to_bytes(8, "little") + data[: MESSAGE_BYTES - 8]
        buf[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        pg.broadcast(buf, 0).wait()
    else:
        # NOTE: a follower waits for the next message as long as the engine idles (the group's timeout would end
        # an idle group); a rank 0 that dies closes its sockets, which fails this wait at once
        pg.broadcast(buf, 0, IDLE_TIMEOUT).wait()
    length = int.from_bytes(buf[:8].numpy().tobytes(), "little")
    rest = length - (MESSAGE_BYTES - 8)
    if rest > 0:
        tail = torch.zeros(rest, dtype=torch.uint8)
        if rank == 0:
            tail.copy_(torch.frombuffer(bytearray(data[MESSAGE_BYTES - 8 :]), dtype=torch.uint8))
        pg.broadcast(tail, 0).wait()
    if rank == 0:
        return obj
    body = buf[8 : 8 + length].numpy().tobytes()
    return pickle.loads(body if rest <= 0 else body + tail.numpy().tobytes())


class RowParallel:
    """A row-parallel linear layer: this rank's partial product, then the all-reduce that sums the ranks' parts."""

    def __init__(self, linear: PackedLinear | Int8Linear, group: TPGroup) -> None:
        self.linear, self.group = linear, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, in / n] → [T, out], summed over the ranks
        y = self.linear(x)
        self.group.all_reduce(y)
        return y


class VocabParallelHead:
    """The LM head split by vocabulary rows: this rank's columns of the logits, gathered on rank 0.

    Rank 0 gets [N, vocab] (what the sampler, grammar masks, penalties and logprobs read); a follower gets its own
    columns back, which it drops (it computes them only for rank 0's gather)."""

    def __init__(self, linear: PackedLinear | Int8Linear, group: TPGroup, vocab: int) -> None:
        self.linear, self.group = linear, group
        self.widths = [len(vocab_rows(vocab, r, group.size)) for r in range(group.size)]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [N, d] → rank 0: [N, vocab]; others: [N, their rows]
        part = self.linear(x)
        full = self.group.gather_columns(part, self.widths)
        return part if full is None else full


def parallelize(model: Any, group: TPGroup) -> None:
    """Make a rank's LlamaModel (built on its shard) tensor parallel: an all-reduce after every o and down
    projection, the LM head's logits gathered on rank 0.

    NOTE: the only change a rank's model needs; a TP 1 engine never calls this (no all-reduce, no wrapper)."""
    for layer in model.layers:
        layer.o = RowParallel(layer.o, group)
        layer.down = RowParallel(layer.down, group)
    model.lm_head = VocabParallelHead(model.lm_head, group, model.cfg.vocab_size)
