"""A cluster worker's TP followers as Ray actors: rank r in bundle r of the worker's placement group (rank 0, the
worker actor, holds bundle 0).

Life of a rank actor:
1. rank 0's engine starts its followers with `launcher(host)` (the engine's `FollowerLauncher` seam, vLLM's "ray"
   executor backend): each rank's shard goes to the object store and the rank's actor is created in its bundle,
   owned by the worker actor, not detached, never restarted (`RayRanks`);
2. the actor builds the rank's runner in its constructor (`TPRank`); `ready()` answers its pid once built;
3. a thread runs the follower's loop (engine/parallel/follower.py `serve_follower`) until rank 0's `Stop`; a loop
   that fails (rank 0 gone, a broken collective) ends the actor's process;
4. rank 0 watches its ranks by pid (`dead`: the group is STRICT_PACK, one node) and ends them with `kill`.

NOTE: "restart as a unit" comes from ownership: Ray ends the actors a process owns when that process dies, so a
worker that ends (a dead rank: cluster/tp_group.py) or is killed takes its ranks with it, and the worker Ray restarts
(in bundle 0 of the same group) starts a fresh set. No half group ever serves.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from cluster.process import pid_alive, pidfd
from engine.config import EngineConfig, ModelConfig
from engine.parallel.follower import build_follower, serve_follower
from engine.parallel.group import Rendezvous
from engine.parallel.launch import FollowerGroup, FollowerLauncher, TPGroupError

if TYPE_CHECKING:
    from cluster.worker_spec import WorkerSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankHost:
    """Where a worker's rank actors go (its placement group) and the process settings they copy from the worker."""

    placement_group: str  # the group's id, hex (pdcluster/launch_actors.py made it; rank r takes bundle r)
    worker: str  # the worker's name, e.g. "decode-0" (rank r logs as "decode-0/rank-r")
    cpus: tuple[int, ...] = ()  # the worker's cores, all its ranks' (empty: not pinned)
    nice: int | None = None
    log_level: str = "INFO"
    log_format: str = "text"

    @classmethod
    def of(cls, spec: WorkerSpec) -> RankHost:
        """The rank host of `spec`'s worker (its spec names a placement group)."""
        return cls(spec.placement_group, spec.name, spec.cpus, spec.nice, spec.log_level, spec.log_format)


@dataclass(frozen=True)
class RankPlace:
    """Where a built rank actor runs, as Ray placed it (its `ready()` answer)."""

    rank: int
    pid: int
    actor_id: str  # hex
    node_id: str  # hex
    placement_group: str  # hex ("" if none: never, as `RayRanks` starts them)


def own_gpu(engine_cfg: EngineConfig) -> EngineConfig:
    """`engine_cfg` with the device a rank actor sees: on CUDA its one GPU, cuda:0.

    NOTE: the runner numbers rank r's GPU as rank 0's process would see it (`rank_device`: the r-th). A rank actor
    reserves num_gpus 1 of its bundle and Ray shows it that GPU alone (CUDA_VISIBLE_DEVICES), as cuda:0; NCCL
    finds the peers' GPUs by their bus ids, not by these indices."""
    return dataclasses.replace(engine_cfg, device="cuda:0") if engine_cfg.device.startswith("cuda") else engine_cfg


class TPRank:
    """One follower rank in a Ray actor's process: builds its runner at once, runs the follower loop on a thread."""

    def __init__(self, rank: int, rdv: Rendezvous, cfg: ModelConfig, engine_cfg: EngineConfig,
                 shard: dict[str, torch.Tensor], num_blocks: int | None, max_model_len: int, host: RankHost) -> None:
        from cluster import logs
        from cluster.process import pin_cpus, set_nice

        logs.configure(f"{host.worker}/rank-{rank}", host.log_level, host.log_format)
        if host.cpus:
            pin_cpus(host.cpus)
        if host.nice is not None:
            set_nice(host.nice)
        self.rank, self.rdv, self.cfg, self.engine_cfg = rank, rdv, cfg, own_gpu(engine_cfg)
        self.runner = build_follower(cfg, self.engine_cfg, shard, num_blocks, max_model_len)
        del shard
        self.thread = threading.Thread(target=self._serve, name=f"tp-rank-{rank}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        # NOTE: the thread's own torch threads and current GPU: both are per thread, not per process
        torch.set_num_threads(self.engine_cfg.threads)
        if self.engine_cfg.device.startswith("cuda"):
            torch.cuda.set_device(self.engine_cfg.device)
        try:
            serve_follower(self.rank, self.rdv, self.cfg, self.engine_cfg, self.runner)
        except BaseException:
            # NOTE: as a follower process would: its end is what rank 0 sees (a dead pid), not a silent actor
            log.exception("TP rank %d: the follower loop failed; ending this process", self.rank)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(1)

    def ready(self) -> RankPlace:
        """Where this rank runs (the call answers once the constructor built the runner)."""
        import ray

        ctx = ray.get_runtime_context()
        return RankPlace(self.rank, os.getpid(), ctx.get_actor_id() or "", ctx.get_node_id(),
                         ctx.get_placement_group_id() or "")

    def wait_done(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the follower loop to leave (after rank 0's Stop); whether it has."""
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


@functools.cache
def rank_actor_class() -> Any:
    """`TPRank` as a Ray actor class (made once per process; ray is imported only where ranks are actors)."""
    import ray

    return ray.remote(TPRank)


class RayRanks:
    """Ranks 1 .. n-1 as Ray actors in bundles 1 .. n-1 of the worker's placement group (a `FollowerGroup`)."""

    def __init__(self, host: RankHost, rdv: Rendezvous, cfg: ModelConfig, rank_cfgs: list[EngineConfig],
                 shards: list[dict[str, torch.Tensor]], num_blocks: int | None, max_model_len: int) -> None:
        import ray
        from ray.util.placement_group import PlacementGroup
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = PlacementGroup(ray.PlacementGroupID(bytes.fromhex(host.placement_group)))
        bundles = pg.bundle_specs
        self.host = host
        self.actors: dict[int, Any] = {}
        self.places: dict[int, RankPlace] = {}  # known once the rank is built
        self._pidfds: dict[int, int | None] = {}  # a pidfd per built rank (None: none to be had; /proc is read)
        for rank, (ecfg, shard) in enumerate(zip(rank_cfgs, shards), start=1):
            bundle = bundles[rank]
            # NOTE: through the object store, on the host: a CUDA shard would be pickled as rank 0's device
            ref = ray.put({k: t.cpu() for k, t in shard.items()})
            self.actors[rank] = rank_actor_class().options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
                # NOTE: not detached: owned by the worker actor, so Ray ends it with the worker's process
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
            ).remote(rank, rdv, cfg, ecfg, ref, num_blocks, max_model_len, host)
            del ref

    def wait_built(self, timeout_s: float) -> None:
        """Return once every rank has built its runner; TPGroupError naming the rank if one failed or died."""
        import ray
        from ray.exceptions import RayError

        deadline = time.monotonic() + timeout_s
        waiting = {a.ready.remote(): rank for rank, a in self.actors.items()}
        while waiting:
            done, _ = ray.wait(list(waiting), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                rank = min(waiting.values())
                raise TPGroupError(f"TP rank {rank} of {self.host.worker} was not built within {timeout_s:.0f} s "
                                   f"(waiting for bundle {rank} of its placement group, or loading its shard)")
            rank = waiting.pop(done[0])
            try:
                place: RankPlace = ray.get(done[0])
            except RayError as e:
                raise TPGroupError(f"TP rank {rank} of {self.host.worker} failed to load its shard:\n{e}") from e
            self.places[rank] = place
            self._pidfds[rank] = pidfd(place.pid)
            if place.node_id != ray.get_runtime_context().get_node_id():
                # NOTE: `dead` watches pids of this node: a group spread over nodes would go unwatched
                raise TPGroupError(f"TP rank {rank} of {self.host.worker} runs on node {place.node_id}, not rank 0's "
                                   "(its placement group must be STRICT_PACK)")

    def dead(self, grace_s: float = 0.0) -> list[str]:
        """'rank r (pid p): ...' for every built rank whose process is gone (waiting up to `grace_s` for one).

        NOTE: by pid, every 50 ms at idle (cluster/tp_group.py) and before each KV read and write: a pidfd poll
        (a read of /proc where there is no pidfd), no call through Ray. Rank 0 and its ranks share a node (the
        placement group is STRICT_PACK; `wait_built` checks it), so the pids are this node's. A pidfd follows its
        process, so a reused pid is no longer missed (it still is on the /proc fallback; rank 0's next collective
        fails then)."""
        deadline = time.monotonic() + grace_s
        while True:
            gone = [p for p in self.places.values() if not self._alive(p)]
            if gone or time.monotonic() >= deadline:
                return [f"rank {p.rank} (pid {p.pid}, a Ray actor): its process ended" for p in gone]
            time.sleep(0.01)

    def _alive(self, place: RankPlace) -> bool:
        # NOTE: `dead` runs before every KV read and write of the hand-off (engine/parallel/runner.py): one poll
        # of the rank's pidfd (readable once it exited), not an open and read of its /proc file
        fd = self._pidfds.get(place.rank)
        if fd is None:
            return pid_alive(place.pid)
        return not select.select([fd], [], [], 0)[0]

    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the ranks' loops to leave (after a Stop), then kill the actors."""
        import ray

        refs = [a.wait_done.remote(timeout_s) for a in self.actors.values()]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s + 1.0)
        self.kill()

    def kill(self) -> None:
        """SIGKILL every built rank's process (at once: rank 0 may end its own next), and ray.kill every actor."""
        for p in self.places.values():
            if pid_alive(p.pid):
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for fd in self._pidfds.values():
            if fd is not None:
                os.close(fd)
        self._pidfds = {r: None for r in self._pidfds}  # NOTE: /proc from now on (kill may be called again)
        try:
            import ray

            for actor in self.actors.values():
                ray.kill(actor, no_restart=True)
        except Exception as e:  # noqa: BLE001 - Ray already gone (a finalizer at exit): the pids are killed above
            log.debug("killing the rank actors of %s: %s", self.host.worker, e)

    def pids(self) -> list[int]:
        """The built ranks' pids, rank 1 first."""
        return [self.places[r].pid for r in sorted(self.places)]


def places(group: FollowerGroup) -> list[RankPlace]:
    """Where the built ranks of `group` run, rank 1 first; empty unless they are Ray actors."""
    return [group.places[r] for r in sorted(group.places)] if isinstance(group, RayRanks) else []


def launcher(host: RankHost) -> FollowerLauncher:
    """The engine's follower launcher for a worker whose ranks are Ray actors of `host`'s placement group."""

    def launch(rdv: Rendezvous, cfg: ModelConfig, rank_cfgs: list[EngineConfig],
               shards: list[dict[str, torch.Tensor]], num_blocks: int | None, max_model_len: int, /) -> FollowerGroup:
        return RayRanks(host, rdv, cfg, rank_cfgs, shards, num_blocks, max_model_len)

    return launch
