"""LoRA adapters on a TP group: each rank's share of an adapter, cut as the base weights are (shard.py).

A wrapped linear adds x @ A.T @ B.T to its output (engine/lora/batch.py). Per rank of TP n:
- column-parallel linears (qkv, gate_up): B's rows are cut as the base weight's output rows (the rank's query heads,
  its KV heads, its MLP width) and A stays whole, so the rank's delta is its own columns of the delta;
- row-parallel linears (o, down): A's columns are cut as the base weight's input columns and B stays whole, so the
  rank's delta is a partial sum of the delta. The LoRA wrapper sits inside `RowParallel` (engine/lora/slots.py
  `wrap`), so the layer's one all-reduce sums it with the base product's partial sums: no collective of its own
  (vLLM's RowParallelLinearWithLoRA does the same).
The adapter is read and checked once, on rank 0 (`LoRASlots.load`); each follower gets its share in a `LoadLoRA`
step message and puts it in the same slot (engine/parallel/follower.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from engine.config import EngineConfig, ModelConfig
from engine.lora.adapter import LoRAAdapter, LoRAPair
from engine.lora.slots import LoRASlots
from engine.model_runner import ModelRunner
from engine.parallel.shard import kv_heads_of


def _out_rows(cfg: ModelConfig, linear: str, rank: int, n: int) -> torch.Tensor:
    """The output rows of a column-parallel fused linear ("qkv", "gate_up") that rank `rank` computes."""
    d = cfg.head_dim
    if linear == "qkv":
        per = cfg.num_heads // n
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        heads = kv_heads_of(cfg, rank, n)
        spans = [(rank * per * d, (rank + 1) * per * d), (q + heads.start * d, q + heads.stop * d),
                 (q + kv + heads.start * d, q + kv + heads.stop * d)]
    else:
        f, width = cfg.intermediate_size, cfg.intermediate_size // n
        spans = [(rank * width, (rank + 1) * width), (f + rank * width, f + (rank + 1) * width)]
    return torch.cat([torch.arange(a, b) for a, b in spans])


def _in_cols(cfg: ModelConfig, linear: str, rank: int, n: int) -> slice:
    """The input columns of a row-parallel linear ("o", "down") that rank `rank` holds."""
    width = cfg.num_heads // n * cfg.head_dim if linear == "o" else cfg.intermediate_size // n
    return slice(rank * width, (rank + 1) * width)


def shard_pair(cfg: ModelConfig, linear: str, pair: LoRAPair, rank: int, n: int) -> LoRAPair:
    """Rank `rank`'s share of one linear's pair (`cfg`: the full model's)."""
    if linear in ("qkv", "gate_up"):
        return dataclasses.replace(pair, b=pair.b[_out_rows(cfg, linear, rank, n).to(pair.b.device)].contiguous())
    return dataclasses.replace(pair, a=pair.a[:, _in_cols(cfg, linear, rank, n)].contiguous())


def shard_adapter(adapter: LoRAAdapter, cfg: ModelConfig, rank: int, n: int) -> LoRAAdapter:
    """Rank `rank`'s share of a loaded adapter (name, key and rank unchanged)."""
    layers = [{linear: shard_pair(cfg, linear, pair, rank, n) for linear, pair in layer.items()}
              for layer in adapter.layers]
    return dataclasses.replace(adapter, layers=layers)


def adapter_to(adapter: LoRAAdapter, device: torch.device) -> LoRAAdapter:
    """`adapter` with its pairs on `device` (a share travels to a follower on the host)."""
    layers = [{linear: dataclasses.replace(pair, a=pair.a.to(device), b=pair.b.to(device))
               for linear, pair in layer.items()} for layer in adapter.layers]
    return dataclasses.replace(adapter, layers=layers)


def rank_share(cfg: ModelConfig, rank: int, n: int) -> Callable[[LoRAAdapter], LoRAAdapter]:
    """What cuts a whole adapter (`cfg`: the full model's) to rank `rank` of TP `n` (`LoRASlots.share`)."""
    return functools.partial(shard_adapter, cfg=cfg, rank=rank, n=n)


def follower_slots(cfg: ModelConfig, engine_cfg: EngineConfig, runner: ModelRunner, rank: int,
                   n: int) -> LoRASlots | None:
    """Rank `rank`'s adapter slots around its (parallelized) model's linears, as rank 0's (`max_loras` > 0): each
    adapter rank 0 loads arrives whole in a `LoadLoRA` message and goes in cut to the rank (`share`); None without
    adapters."""
    return LoRASlots.around(runner, cfg, engine_cfg, rank_share(cfg, rank, n)) if engine_cfg.max_loras else None
