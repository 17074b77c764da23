"""The KV pool of a CUDA engine sized by `gpu_memory_utilization`, in vLLM's meaning: this engine's share of the GPU.

1. The model's weights are on the GPU already.
2. Run one profiling forward pass of max_num_batched_tokens prompt tokens (one sequence, a KV pool just big enough)
   and the head over max_num_seqs rows; read torch's peak allocation (weights + activations + that small pool).
3. KV gets `gpu_memory_utilization x total - (peak - the profiling pool)`, in whole blocks, capped at what
   max_num_seqs full-length sequences could use. The share is per engine, as vLLM's is per instance: two engines on
   one GPU at 0.45 each both fit. What other processes hold is not subtracted; a share that does not fit in what is
   free (the KV pool, plus the activations the profile freed) is refused naming the field, as is one too small for
   a block.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.errors import InvalidRequestError

log = logging.getLogger(__name__)

DEFAULT_UTILIZATION = 0.9  # vLLM's default


def kv_budget_bytes(total: int, utilization: float, peak: int, profile_kv: int) -> int:
    """Bytes left for the KV pool (step 3 of the module docstring); negative when nothing is."""
    return int(total * utilization) - (peak - profile_kv)


@torch.inference_mode()
def profile_num_blocks(runner: Any, engine_cfg: EngineConfig, max_blocks: int | None) -> int:
    """Blocks of the KV pool on `runner`'s CUDA device (an engine.model_runner.ModelRunner with its model built, its
    KV not yet; see the module docstring); `max_blocks` caps it."""
    device = runner.device
    if device.type != "cuda":
        raise InvalidRequestError("num_blocks", f"sizing the KV pool by profiling needs CUDA (device {device}); "
                                                "give num_blocks or kv_cache_memory_gb")
    utilization = engine_cfg.gpu_memory_utilization or DEFAULT_UTILIZATION
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    total = torch.cuda.mem_get_info(device)[1]
    tokens = engine_cfg.max_num_batched_tokens
    bs = runner.block_size
    blocks = -(-tokens // bs)
    runner._allocate_kv(blocks + 1)
    profile_kv = runner.kv.numel() * runner.kv.element_size()
    meta = AttentionMetadata.build([list(range(blocks))], [0], [tokens], bs, kernel=runner.attn_kernel,
                                   backend=runner.attn_backend, device=device)
    ids = torch.zeros(tokens, dtype=torch.long, device=device)
    hidden = runner.model(ids, torch.arange(tokens, device=device), runner.kv_caches, meta)
    runner.model.logits(hidden[: min(tokens, engine_cfg.max_num_seqs)]).float().softmax(-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del runner.kv, runner.kv_caches, hidden, meta
    torch.cuda.empty_cache()
    per_block = profile_kv // (blocks + 1)
    budget = kv_budget_bytes(total, utilization, peak, profile_kv)
    num_blocks = budget // per_block
    gib = 2**30
    if num_blocks < 1:
        raise InvalidRequestError("gpu_memory_utilization", f"{utilization} of {total / gib:.1f} GiB leaves no room "
                                  f"for KV after weights and activations (peak {peak / gib:.2f} GiB); raise it or "
                                  "lower max_num_batched_tokens")
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    free = torch.cuda.mem_get_info(device)[0]
    needed = num_blocks * per_block + (peak - profile_kv - torch.cuda.memory_allocated(device))
    if needed > free:
        share = total * utilization / gib
        raise InvalidRequestError("gpu_memory_utilization", f"a share of {utilization} ({share:.1f} GiB) needs "
                                  f"{needed / gib:.2f} GiB more for KV and activations, and {free / gib:.2f} GiB of "
                                  "the GPU are free (other processes hold the rest); lower it")
    log.info("KV pool: %d blocks (%.2f GiB) on %s (gpu_memory_utilization %.2f, profiling peak %.2f GiB)",
             num_blocks, num_blocks * per_block / 2**30, device, utilization, peak / 2**30)
    return int(num_blocks)
