"""Ranks 1 .. n-1 of a TP group: a plain class that computes the steps rank 0 broadcasts, and its process entry.

Life of a follower:
1. its host (a spawned process, `follower_main`, or in a cluster a Ray actor of the worker's placement group,
   cluster/tp_ranks.py) builds a `ModelRunner` on the rank's shard of the weights and its own KV pool shard
   (`build_follower`), reports it built;
2. joins the group (`TPGroup`), shares its KV pool with rank 0 on the CPU (`shared_pool.share_pool`), and wraps
   the model's o and down projections with the all-reduce and its LM head with the logits' gather (`parallelize`),
   then its linears with LoRA slots when the engine serves adapters (`lora.follower_slots`);
3. `TPFollower.run` takes one message per step from rank 0 (`StepMessage`: the step's flat inputs, block tables and
   adapters; `CopyBlock`; `LoadLoRA` / `UnloadLoRA`; `Stop`) and computes it: the same forward as rank 0, whose
   all-reduces it meets, its columns of the logits for rank 0's gather, no sampling, no scheduling (rank 0's block
   manager decides every block; the tables arrive with the step);
4. a `Stop`, or a failed collective (rank 0 is gone), ends the loop; a follower process whose parent (rank 0's)
   is gone ends itself too (`watch_parent`), whatever it is doing (a rank actor dies with its owner, rank 0).
Beside it, a thread answers the KV hand-off's reads and writes of the rank's pool (`kv.KVService`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.lora.adapter import LoRAAdapter
from engine.lora.slots import LoRASlots, slots_of
from engine.model_runner import ModelRunner
from engine.parallel.group import Rendezvous, TPGroup, parallelize
from engine.parallel.kv import KVService
from engine.parallel.lora import adapter_to, follower_slots
from engine.parallel.shard import rank_config
from engine.parallel.shared_pool import share_pool

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepMessage:
    """What a follower needs of one step: the flat batch (as rank 0's `ModelRunner.prepare` laid it out)."""

    input_ids: list[int]  # [T]
    starts: list[int]  # per sequence: tokens computed before this step (its positions follow on)
    num_new: list[int]  # per sequence: tokens this step computes
    tables: list[list[int]]  # per sequence: its block table (rank 0's block manager's)
    rows: list[int]  # flat indices that need logits (each rank computes its vocabulary columns of them)
    loras: list[str | None]  # per sequence: its LoRA adapter (None: the base); empty when no sequence has one


@dataclass(slots=True)
class CopyBlock:
    """Copy one block's K/V in every layer (a forked sequence's copy-on-write block)."""

    src: int
    dst: int


@dataclass(slots=True)
class LoadLoRA:
    """Put this rank's share of adapter `name` into `slot` (engine/parallel/lora.py), as rank 0 loaded it."""

    name: str
    slot: int
    adapter: LoRAAdapter  # whole, on the host (each rank cuts its own share)


@dataclass(slots=True)
class UnloadLoRA:
    """Free adapter `name`'s slot, as rank 0 did."""

    name: str


@dataclass(slots=True)
class Stop:
    """The group is closing: leave the loop."""


def rank_engine_config(engine_cfg: EngineConfig, device: str, threads: int) -> EngineConfig:
    """The engine settings one rank's runner is built with: its device and threads, eager (see TPModelRunner)."""
    return dataclasses.replace(engine_cfg, device=device, num_threads=threads, enforce_eager=True)


def rank_runner(cfg: ModelConfig, engine_cfg: EngineConfig, shard: dict[str, torch.Tensor], num_blocks: int | None,
                max_model_len: int) -> ModelRunner:
    """A plain runner over one rank's shard: the rank's heads and MLP width, its KV heads' pool (`num_blocks` None
    on CUDA: sized by gpu_memory_utilization on this rank's GPU, then agreed with the others: `agree_pool`)."""
    torch.set_num_threads(engine_cfg.threads)
    return ModelRunner(rank_config(cfg, engine_cfg.tensor_parallel_size), engine_cfg, shard, num_blocks,
                       max_model_len)


class TPFollower:
    """One follower rank: computes each step message on its shard (driven by `run`, or by `handle` per message)."""

    def __init__(self, runner: ModelRunner, group: TPGroup, lora: LoRASlots | None = None) -> None:
        self.runner, self.group, self.lora = runner, group, lora
        self.steps = 0

    @torch.inference_mode()
    def handle(self, msg: StepMessage | CopyBlock | LoadLoRA | UnloadLoRA | Stop) -> bool:
        """Compute one message; False once it is `Stop`."""
        r = self.runner
        if isinstance(msg, Stop):
            return False
        if isinstance(msg, CopyBlock):
            r.copy_block(msg.src, msg.dst)
            return True
        if isinstance(msg, LoadLoRA):  # NOTE: whole, on the host: this rank's share of it goes to its device
            slots = slots_of(self.lora)
            slots.install(msg.name, msg.slot, adapter_to(slots.share(msg.adapter), r.device))
            return True
        if isinstance(msg, UnloadLoRA):
            slots_of(self.lora).unload(msg.name, [])  # NOTE: rank 0 checked that no request uses it
            return True
        if msg.loras:
            slots_of(self.lora).begin(msg.loras, msg.num_new)
        try:
            self._step(msg)
        finally:
            if self.lora is not None:
                self.lora.end()
        self.steps += 1
        return True

    def _step(self, msg: StepMessage) -> None:
        r = self.runner
        # NOTE: the metadata is rebuilt here from the step's lists, with the same host code rank 0 ran: cheaper to
        # ship than its tensors (a dozen per step, backend-specific, on the device on CUDA)
        with r.on_device():
            meta = AttentionMetadata.build(msg.tables, msg.starts, msg.num_new, r.block_size, kernel=r.attn_kernel,
                                           cascade=r.attn_cascade, prefill=r.attn_prefill, backend=r.attn_backend,
                                           device=r.device)
            positions = [p for start, n in zip(msg.starts, msg.num_new) for p in range(start, start + n)]
            ids, pos, rows = r.to_device(msg.input_ids, positions, msg.rows)
            hidden = r.model(ids, pos, r.kv_caches, meta)  # [T, d]
            if msg.rows:  # NOTE: this rank's vocabulary columns, for rank 0's gather; rank 0 alone samples
                r.model.logits(hidden.index_select(0, rows))

    def run(self) -> None:
        """Take rank 0's messages until `Stop`; a failed collective (rank 0 gone) ends it with an error logged."""
        try:
            while self.handle(self.group.broadcast_object()):
                pass
        except RuntimeError as e:
            log.error("TP rank %d: the group failed after %d steps (%s); leaving", self.group.rank, self.steps, e)
            raise


PARENT_POLL_S = 0.5  # how often a follower checks that rank 0's process is still its parent


def watch_parent(rank: int) -> threading.Thread:
    """A daemon thread that ends this process once its parent (rank 0's process) is gone.

    NOTE: a SIGKILLed rank 0 (a worker actor killed by Ray, the OOM killer) leaves its followers orphaned: daemonic
    only means "joined at a normal exit". A follower blocked in a collective usually fails at once when rank 0's
    sockets close, but one still loading its shard, or one whose peer's sockets linger, would live on holding its
    GPU. Not prctl(PR_SET_PDEATHSIG): it fires when the *thread* that spawned the follower ends, and rank 0's
    engine may be built on a thread that ends long before the process (an actor's start-up thread).
    """
    parent = os.getppid()

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        log.error("TP rank %d: rank 0's process (pid %d) is gone; leaving", rank, parent)
        os._exit(1)

    t = threading.Thread(target=poll, daemon=True, name=f"tp-rank-{rank}-parent")
    t.start()
    return t


def agree_pool(runner: ModelRunner, group: TPGroup) -> None:
    """Every rank's pool at the smallest rank's block count (a collective: each rank calls it once, right after it
    joined the group).

    NOTE: with `num_blocks` or `kv_cache_memory_gb` set the counts are equal already; by gpu_memory_utilization each
    rank profiled its own GPU (another process may hold some of one GPU), and block i of a sequence must exist on
    every rank."""
    num_blocks = group.min(runner.num_blocks)
    if num_blocks == runner.num_blocks:
        return
    # NOTE: no request has used the pool yet, and a rank's runner is eager (no decode graphs sized by it)
    assert runner.graphs is None
    del runner.kv, runner.kv_caches
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()  # NOTE: the larger pool's memory goes back before the smaller one is taken
    runner.num_blocks = runner.spare_block = num_blocks
    runner._allocate_kv(num_blocks + 1)


def build_follower(cfg: ModelConfig, engine_cfg: EngineConfig, shard: dict[str, torch.Tensor], num_blocks: int | None,
                   max_model_len: int) -> ModelRunner:
    """Step 1 of a follower's life, in its host: the rank's runner on its shard (on its device)."""
    if engine_cfg.device.startswith("cuda"):
        torch.cuda.set_device(engine_cfg.device)  # NOTE: NCCL binds a rank to the current device
    return rank_runner(cfg, engine_cfg, shard, num_blocks, max_model_len)


def serve_follower(rank: int, rdv: Rendezvous, cfg: ModelConfig, engine_cfg: EngineConfig,
                   runner: ModelRunner) -> None:
    """Steps 2-4 of a follower's life: join the group, answer KV reads and writes beside the steps, run the steps
    until `Stop` (a failed collective raises)."""
    group = TPGroup(rank, rdv, runner.device)
    agree_pool(runner, group)
    share_pool(runner, group)  # NOTE: rank 0 then reads and writes its KV heads in place (CPU)
    parallelize(runner.model, group)
    lora = follower_slots(cfg, engine_cfg, runner, rank, group.size)  # NOTE: after parallelize (see `wrap`)
    kv = KVService(runner, group, cfg)  # NOTE: the KV hand-off's reads and writes, beside the steps
    kv.start()
    try:
        TPFollower(runner, group, lora).run()
    finally:
        # NOTE: rank 0 stops the KV thread before the steps (`TPModelRunner.close`: StopKV, then Stop), but on its
        # own pipe: the thread may not have read it yet. It leaves before the group closes under it (its pipe, and
        # the gloo group whose destructor aborts a process still inside one of its calls)
        kv.thread.join(10.0)
        group.close()


def follower_main(rank: int, rdv: Rendezvous, cfg: ModelConfig, engine_cfg: EngineConfig, num_blocks: int | None,
                  max_model_len: int, conn: Connection) -> None:
    """A follower process: take its shard from `conn`, build, report ("built" or the traceback) on `conn`, join the
    group, run."""
    watch_parent(rank)
    try:
        shard: dict[str, torch.Tensor] = conn.recv()
        runner = build_follower(cfg, engine_cfg, shard, num_blocks, max_model_len)
        del shard
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    conn.send(("built", ""))
    conn.close()
    serve_follower(rank, rdv, cfg, engine_cfg, runner)
