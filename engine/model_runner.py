"""Owns the model and the KV memory; turns a scheduled batch into tensors, runs it and samples.

The runner makes no scheduling decisions: it computes what the scheduler picked.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig, torch_dtype
from engine.model import LlamaModel
from engine.sampler import sample
from engine.scheduler import ScheduledBatch


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers."""
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    """Runs forward passes over the paged KV cache (`kv[layer][0|1]`: [num_blocks, block_size, KVH, D])."""

    def __init__(self, cfg: ModelConfig, engine_cfg: EngineConfig, weights: dict[str, torch.Tensor],
                 num_blocks: int, max_model_len: int) -> None:
        self.cfg = cfg
        self.dtype = torch_dtype(engine_cfg.dtype)
        self.block_size = engine_cfg.block_size
        self.model = LlamaModel(cfg, weights, self.dtype, max_model_len)
        shape = (cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = torch.zeros(shape, dtype=self.dtype)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(cfg.num_layers)]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, layer_hook: Callable[[int], None] | None = None) -> list[int | None]:
        """Compute the batch; return the sampled token of each sequence that reached its end, else None.

        `layer_hook(i)` runs after layer i has written its K/V (layer-wise KV sending).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        sample_rows: list[int] = []  # flat index of the last token of sequences that sample
        sampling: list[int] = []  # their index in the batch
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            starts.append(start)
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            if start + n == len(seq):
                sample_rows.append(len(input_ids) - 1)
                sampling.append(i)
        meta = AttentionMetadata.build([s.block_table for s in batch.seqs], starts, batch.num_new_tokens,
                                       self.block_size)
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta,
                            layer_hook)
        out: list[int | None] = [None] * len(batch.seqs)
        if not sample_rows:
            return out
        logits = self.model.logits(hidden[sample_rows]).float()  # [N, vocab]
        tokens = sample(logits, [batch.seqs[i].params for i in sampling],
                        [batch.seqs[i].num_output_tokens for i in sampling])
        for i, tok in zip(sampling, tokens):
            out[i] = tok
        return out

    @torch.inference_mode()
    def read_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of `block_ids` in `layer`: each [n, block_size, KVH, D]."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        return self.kv[layer, 0, idx], self.kv[layer, 1, idx]  # advanced indexing copies

    @torch.inference_mode()
    def write_blocks(self, layer: int, which: int, block_ids: list[int], kv: torch.Tensor) -> None:
        """Store K (which=0) or V (1), [n, block_size, KVH, D], into `block_ids` of `layer`."""
        self.kv[layer, which].index_copy_(0, torch.tensor(block_ids, dtype=torch.long), kv.to(self.dtype))
