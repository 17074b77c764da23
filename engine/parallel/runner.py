"""Rank 0 of a TP group: a ModelRunner on rank 0's shard that broadcasts each step to the followers first.

The engine above it (scheduler, block manager, sampler, outputs) is unchanged and sees one runner: rank 0's block
manager decides every block of every rank's pool (the pools have the same block count, and block i of a sequence
is block i on every rank, holding that rank's KV heads); rank 0 alone samples, from the logits it gathers from
every rank's vocabulary columns.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterator

import torch

from engine.config import EngineConfig, ModelConfig
from engine.lora.adapter import LoRAAdapter
from engine.model_runner import ModelRunner
from engine.parallel.follower import CopyBlock, LoadLoRA, StepMessage, Stop, UnloadLoRA, agree_pool, rank_engine_config
from engine.parallel.group import TPGroup, parallelize, serve_store
from engine.parallel.kv import KVChannelClosed, KVGather
from engine.parallel.launch import FollowerGroup, FollowerLauncher, Followers, TPGroupError
from engine.parallel.lora import adapter_to
from engine.parallel.shard import check_tp, rank_config, shard_weights
from engine.parallel.shared_pool import map_pools
from engine.scheduler import ScheduledBatch
from engine.step import Step, layout

BUILD_TIMEOUT_S = 600.0  # a follower's load of its shard (weights packed for the kernel)


def rank_device(engine_cfg: EngineConfig, rank: int) -> str:
    """Rank `rank`'s device: the CPU for every rank, or the rank-th GPU from the engine's own on CUDA.

    NOTE: as rank 0's process sees the GPUs. A launcher whose ranks see only their own GPU (Ray actors: cuda:0 in
    each) sets each rank's device itself (cluster/tp_ranks.py)."""
    dev = engine_cfg.resolved_device()
    return "cpu" if dev.type == "cpu" else f"cuda:{(dev.index or 0) + rank}"


def rank_threads(engine_cfg: EngineConfig) -> int:
    """Torch threads per rank: `num_threads` when set (per rank), else this machine's cores shared by the ranks."""
    if engine_cfg.num_threads is not None:
        return engine_cfg.num_threads
    return max(1, len(os.sched_getaffinity(0)) // engine_cfg.tensor_parallel_size)


class TPModelRunner(ModelRunner):
    """The runner of a TP n engine (n > 1): starts the n - 1 followers, computes rank 0's part of each step.

    NOTE: CUDA graphs are off (every rank eager: a graph would have to be captured on every rank in step, the
    all-reduces inside it); the KV pool is sized per rank (`num_blocks`, `kv_cache_memory_gb`, or on CUDA
    gpu_memory_utilization, each rank profiling its own GPU before the group forms), then every rank takes the
    smallest count (`agree_pool`). The KV hand-off sees the full model's layout
    (all KV heads, as a TP 1 engine has them): `read_blocks` takes every rank's heads and `write_blocks` gives each
    rank its own, in the followers' pools mapped here on the CPU, else through their KV threads
    (engine/parallel/kv.py), so a prefill group of any TP size hands its KV to a decode engine of any other.
    """

    def __init__(self, cfg: ModelConfig, engine_cfg: EngineConfig, weights: dict[str, torch.Tensor],
                 num_blocks: int | None, max_model_len: int, *, max_blocks: int | None = None,
                 launcher: FollowerLauncher | None = None) -> None:
        n = engine_cfg.tensor_parallel_size
        check_tp(cfg, n)
        threads = rank_threads(engine_cfg)
        cfgs = [rank_engine_config(engine_cfg, rank_device(engine_cfg, r), threads) for r in range(n)]
        store, rdv = serve_store(n)
        shards = [shard_weights(cfg, weights, r, n) for r in range(1, n)]
        # NOTE: processes of this machine unless the caller hosts the ranks itself (a cluster: Ray actors)
        followers: FollowerGroup = (launcher or Followers)(rdv, cfg, cfgs[1:], shards, num_blocks, max_model_len)
        try:
            torch.set_num_threads(threads)
            super().__init__(rank_config(cfg, n), cfgs[0], shard_weights(cfg, weights, 0, n), num_blocks,
                             max_model_len, max_blocks=max_blocks)
            followers.wait_built(BUILD_TIMEOUT_S)
            # NOTE: kept until every follower built its runner: CUDA tensors sent to another process must stay alive
            # on the sender's side while the receiver still reads them
            del shards
            self.group = TPGroup(0, rdv, self.device, store)
            agree_pool(self, self.group)
            pools = map_pools(self, self.group)  # NOTE: the followers' pools, where they are shared (CPU)
        except BaseException:
            followers.kill()
            raise
        parallelize(self.model, self.group)
        self.kv_gather = KVGather(self, self.group, cfg, pools)
        self.followers = followers
        self.full_config = cfg
        self.failure: TPGroupError | None = None
        self._closer = weakref.finalize(self, followers.kill)

    # ---- what the followers must mirror -------------------------------------------------------------
    def _send(self, msg: StepMessage | CopyBlock | LoadLoRA | UnloadLoRA | Stop) -> None:
        if self.failure is not None:
            raise self.failure
        try:
            self.group.broadcast_object(msg)
        except RuntimeError as e:
            raise self._failed(e) from e

    def prepare(self, batch: ScheduledBatch, graphed: bool = True) -> Step:
        """rank 0's step (as ModelRunner.prepare), its message broadcast to the followers first.

        NOTE: sent before rank 0 builds its own metadata, so the followers build theirs meanwhile (sent after, they
        would reach the first all-reduce one metadata build behind rank 0, and rank 0 would wait that long there).
        """
        step = layout(batch)
        loras = [s.params.lora for s in batch.seqs]
        self._send(StepMessage(step.input_ids, step.starts, list(batch.num_new_tokens),
                               [list(s.block_table) for s in batch.seqs], step.rows,
                               loras if any(n is not None for n in loras) else []))
        return self.build(batch, step, graphed=False)

    def execute(self, batch: ScheduledBatch, layer_hook: Callable[[int], None] | None = None,
                lookahead: bool = False) -> list[list[int]]:
        """ModelRunner.execute; a broken collective becomes TPGroupError naming the dead rank(s)."""
        try:
            return super().execute(batch, layer_hook, lookahead)
        except TPGroupError:
            raise
        except RuntimeError as e:
            raise self._failed(e) from e

    def copy_block(self, src: int, dst: int) -> None:
        self._send(CopyBlock(src, dst))
        super().copy_block(src, dst)

    def load_lora(self, name: str, slot: int, adapter: LoRAAdapter) -> None:
        """Send the followers an adapter rank 0 just loaded into `slot`, whole and on the host: each puts its own
        share of it in the same slot (engine/parallel/lora.py)."""
        self._send(LoadLoRA(name, slot, adapter_to(adapter, torch.device("cpu"))))

    def unload_lora(self, name: str) -> None:
        self._send(UnloadLoRA(name))

    def read_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of `block_ids` in `layer` with every KV head, gathered from the ranks: each
        [n, block_size, KVH, D] (int8: with the scale row), on rank 0's device; TPGroupError if a rank is gone."""
        with self._kv_channel():
            return self.kv_gather.read(layer, block_ids)

    def write_blocks(self, layer: int, which: int, block_ids: list[int], kv: torch.Tensor) -> None:
        """Store K (which=0) or V (1) of every KV head, [n, block_size, KVH, D], into `block_ids` of `layer`: each
        rank its heads (any thread: the seam's receivers write while the engine steps); TPGroupError if a rank is
        gone."""
        with self._kv_channel():
            self.kv_gather.write(layer, which, block_ids, kv)

    @contextlib.contextmanager
    def _kv_channel(self) -> Iterator[None]:
        """A KV read or write: TPGroupError at once from a failed or closed group, or naming the rank that broke it."""
        if self.failure is not None:
            raise self.failure
        if self.kv_gather.pools and (dead := self.followers.dead()):
            # NOTE: a dead rank's pool mapped here still reads and writes: its pid says it is gone (a closed socket did)
            raise self._failed(RuntimeError("; ".join(dead)))
        try:
            yield
        except KVChannelClosed as e:
            raise self.failure or TPGroupError(str(e)) from e
        except RuntimeError as e:
            raise self._failed(e) from e

    # ---- failure and shutdown ----------------------------------------------------------------------
    def _failed(self, e: RuntimeError) -> TPGroupError:
        """The group's failure (kept: every later step fails at once, no collective with a broken group)."""
        dead = self.followers.dead(grace_s=0.5)
        self.followers.kill()  # NOTE: the others, maybe stuck in a collective: the group is out as a whole
        reason = f"({e})" if not dead else "; ".join(dead)
        self.failure = TPGroupError(f"tensor-parallel group of {self.group.size} failed: {reason}")
        return self.failure

    def close(self) -> None:
        """Stop the followers (a Stop message, then SIGKILL for any that is left after 10 s)."""
        if self.failure is None:
            try:
                self.kv_gather.stop()  # NOTE: first: the followers' KV threads leave before their processes end
                self._send(Stop())
            except TPGroupError:
                pass
            except RuntimeError as e:
                self._failed(e)
        self.failure = self.failure or TPGroupError("the tensor-parallel group is closed")
        self.followers.join(10.0)
        self.group.close()
        self._closer.detach()


def make_runner(cfg: ModelConfig, engine_cfg: EngineConfig, weights: dict[str, torch.Tensor],
                num_blocks: int | None, max_model_len: int, *, max_blocks: int | None = None,
                launcher: FollowerLauncher | None = None) -> ModelRunner:
    """The engine's runner: a plain ModelRunner for TP 1 (unchanged: no group, no all-reduce), else rank 0's (its
    followers started by `launcher`, processes of this machine by default)."""
    if engine_cfg.tensor_parallel_size == 1:
        return ModelRunner(cfg, engine_cfg, weights, num_blocks, max_model_len, max_blocks=max_blocks)
    return TPModelRunner(cfg, engine_cfg, weights, num_blocks, max_model_len, max_blocks=max_blocks,
                         launcher=launcher)
