"""How a TP group's followers (ranks 1 .. n-1) are started: the seam (`FollowerLauncher` → `FollowerGroup`) and
its default, processes of this machine (`Followers`).

The seam is vLLM's `distributed_executor_backend` ("mp" or "ray"): rank 0 (`TPModelRunner`) takes a launcher, and
needs of the group it gets only these: wait until every rank built its runner, name the dead, stop them. The
engine's own launcher, `Followers`, spawns processes (the Python API, `pdcluster bench engine`); a cluster's worker
passes its own, which hosts each rank in a Ray actor of the worker's placement group (cluster/tp_ranks.py).

NOTE: spawned, not forked (a fork of a process with torch's thread pools can deadlock). Each follower gets its
shard through a pipe: torch's multiprocessing moves CPU tensors into shared memory, so a shard is written once and
not pickled byte by byte.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Protocol

import torch
import torch.multiprocessing as mp

from engine.config import EngineConfig, ModelConfig
from engine.errors import EngineError
from engine.parallel.follower import follower_main
from engine.parallel.group import Rendezvous


class TPGroupError(EngineError):
    """A rank of a tensor-parallel group failed (died, or its collective broke): the whole group is out."""


class FollowerGroup(Protocol):
    """Ranks 1 .. n-1 of a TP group as rank 0 sees them, however they were started."""

    def wait_built(self, timeout_s: float) -> None:
        """Return once every rank has built its runner; TPGroupError naming the rank if one failed or died."""

    def dead(self, grace_s: float = 0.0) -> list[str]:
        """'rank r (pid p): how it ended' for every rank no longer running (waiting up to `grace_s` for one)."""

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the ranks to leave (after a Stop), then kill the ones still running."""

    def kill(self) -> None:
        """End every rank still running, at once."""

    def pids(self) -> list[int]:
        """The ranks' process ids, rank 1 first (those known so far)."""


class FollowerLauncher(Protocol):
    """Starts ranks 1 .. n-1 of a group (`rank_cfgs[i]` and `shards[i]` are rank i + 1's); the caller joins them."""

    def __call__(self, rdv: Rendezvous, cfg: ModelConfig, rank_cfgs: list[EngineConfig],
                 shards: list[dict[str, torch.Tensor]], num_blocks: int | None, max_model_len: int,
                 /) -> FollowerGroup: ...


@dataclass
class Follower:
    """One started follower process and the pipe it reports its build on."""

    rank: int
    process: BaseProcess
    conn: Connection


def describe_exit(code: int | None) -> str:
    """'exit code 1' or 'killed by SIGKILL' for a process's exit code (None: still running)."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Followers:
    """Ranks 1 .. n-1 as processes of this machine (the engine's own `FollowerLauncher`)."""

    def __init__(self, rdv: Rendezvous, cfg: ModelConfig, rank_cfgs: list[EngineConfig],
                 shards: list[dict[str, torch.Tensor]], num_blocks: int | None, max_model_len: int) -> None:
        ctx = mp.get_context("spawn")
        self.rdv = rdv
        self.procs: list[Follower] = []
        for rank, (ecfg, shard) in enumerate(zip(rank_cfgs, shards), start=1):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=follower_main, name=f"tp-rank-{rank}", daemon=True,
                            args=(rank, rdv, cfg, ecfg, num_blocks, max_model_len, theirs))
            p.start()
            theirs.close()
            # NOTE: through the pipe, not the process's arguments: the Process object would keep those (a copy of
            # the follower's shard held here for the group's life); the caller's shards go once this returns
            ours.send(shard)
            self.procs.append(Follower(rank, p, ours))

    def wait_built(self, timeout_s: float) -> None:
        """Return once every follower has built its runner; TPGroupError naming the rank if one failed or died."""
        deadline = time.monotonic() + timeout_s
        for f in self.procs:
            while not f.conn.poll(0.05):
                if not f.process.is_alive():
                    raise TPGroupError(f"TP rank {f.rank} (pid {f.process.pid}) died while loading its shard "
                                       f"({describe_exit(f.process.exitcode)})")
                if time.monotonic() > deadline:
                    raise TPGroupError(f"TP rank {f.rank} (pid {f.process.pid}) did not load its shard within "
                                       f"{timeout_s:.0f} s")
            try:
                status, detail = f.conn.recv()
            except EOFError:  # NOTE: the pipe closed with nothing sent: the process ended before reporting
                f.process.join(1.0)
                status, detail = "died", describe_exit(f.process.exitcode)
            f.conn.close()
            if status != "built":
                raise TPGroupError(f"TP rank {f.rank} failed to load its shard:\n{detail}")

    def dead(self, grace_s: float = 0.0) -> list[str]:
        """'rank r (pid p): how it ended' for every follower that is no longer running (waiting up to `grace_s` for
        the first to end)."""
        deadline = time.monotonic() + grace_s
        while all(f.process.is_alive() for f in self.procs) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [f"rank {f.rank} (pid {f.process.pid}): {describe_exit(f.process.exitcode)}"
                for f in self.procs if not f.process.is_alive()]

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the followers to leave, then kill the ones still running."""
        deadline = time.monotonic() + timeout_s
        for f in self.procs:
            f.process.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """SIGKILL every follower still running and reap it."""
        for f in self.procs:
            if f.process.is_alive() and f.process.pid is not None:
                os.kill(f.process.pid, signal.SIGKILL)
            f.process.join(5.0)

    def pids(self) -> list[int]:
        """The followers' process ids, rank 1 first."""
        return [f.process.pid for f in self.procs if f.process.pid is not None]
