"""Owns the model and the KV memory; turns a scheduled batch into tensors, runs it and samples.

The runner makes no scheduling decisions: it computes what the scheduler picked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig, torch_dtype
from engine.errors import InvalidRequestError
from engine.kernels import attention_kernel
from engine.kv_quant import int8_block_rows
from engine.logprobs import prompt_logprobs, prompt_rows, sampled_logprobs
from engine.model import LlamaModel
from engine.sampler import sample
from engine.scheduler import ScheduledBatch
from engine.spec_decode import verify
from engine.structured_output import grammar_bitmask


def kv_cache_dtype(engine_cfg: EngineConfig) -> torch.dtype:
    """How KV is stored: int8 for kv_cache_dtype="int8", else the engine's dtype."""
    return torch.int8 if engine_cfg.kv_cache_dtype == "int8" else torch_dtype(engine_cfg.dtype)


def kv_block_rows(block_size: int, dtype: torch.dtype) -> int:
    """Rows of one block in the KV memory: its tokens, plus the scale row of an int8 block."""
    return int8_block_rows(block_size) if dtype == torch.int8 else block_size


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one block across all layers (an int8 block's scales included)."""
    return 2 * cfg.num_layers * kv_block_rows(block_size, dtype) * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


class ModelRunner:
    """Runs forward passes over the paged KV cache (`kv[layer][0|1]`: [num_blocks, block_size, KVH, D]).

    With an int8 KV cache a block has one more row, for its per-head scales (engine/kv_quant.py).
    """

    def __init__(self, cfg: ModelConfig, engine_cfg: EngineConfig, weights: dict[str, torch.Tensor],
                 num_blocks: int, max_model_len: int) -> None:
        self.cfg = cfg
        self.dtype = torch_dtype(engine_cfg.dtype)
        self.kv_dtype = kv_cache_dtype(engine_cfg)
        self.block_size = engine_cfg.block_size
        self.model = LlamaModel(cfg, weights, self.dtype, max_model_len, engine_cfg.quantization)
        if self.kv_dtype == torch.int8 and cfg.head_dim < 4:
            raise InvalidRequestError("kv_cache_dtype", f"int8 KV needs head_dim >= 4 (its scale row), got "
                                      f"{cfg.head_dim}")
        rows = kv_block_rows(self.block_size, self.kv_dtype)
        shape = (cfg.num_layers, 2, num_blocks, rows, cfg.num_kv_heads, cfg.head_dim)
        self.kv = torch.zeros(shape, dtype=self.kv_dtype)
        self.kv_caches = [(self.kv[i, 0], self.kv[i, 1]) for i in range(cfg.num_layers)]
        # NOTE: None = the pure-torch gather path (kernel not built, or PDCLUSTER_ATTENTION=gather); read once here
        # so every step of this engine takes the same path.
        self.attn_kernel = attention_kernel()
        self.attn_cascade = True  # shared decode prefixes attended once per group (kernel path)
        self.attn_prefill: Literal["flash", "chunked"] = "flash"  # engine/attention/paged.py PREFILL_MODES

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, layer_hook: Callable[[int], None] | None = None) -> list[list[int]]:
        """Compute the batch; return the new tokens of each sequence that reached its end ([] for the others).

        A sequence with draft tokens (`spec_token_ids`, trimmed by the scheduler to what it scheduled) gets them
        verified: its tokens are the accepted drafts plus one from the model. Others get one sampled token.
        `layer_hook(i)` runs after layer i has written its K/V (layer-wise KV sending).
        """
        input_ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        sample_rows: list[int] = []  # flat index of the last token of sequences that sample one token
        sampling: list[int] = []  # their index in the batch
        verifying: list[tuple[int, int]] = []  # (index in the batch, flat index of its first verified row)
        scoring: list[tuple[int, int, int]] = []  # prompt logprobs: (index in the batch, first position, count)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            starts.append(start)
            positions.extend(range(start, start + n))
            draft = seq.spec_token_ids  # NOTE: n counts them: they follow the sequence's last (pending) token
            input_ids.extend([*seq.token_ids[start : start + n], *draft])
            if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0:
                first, count = prompt_rows(seq.num_prompt_tokens, len(seq.prompt_logprobs), start, n)
                if count:
                    scoring.append((i, first, count))
            if draft:
                verifying.append((i, len(input_ids) - len(draft) - 1))
            elif start + n == len(seq):
                sample_rows.append(len(input_ids) - 1)
                sampling.append(i)
        meta = AttentionMetadata.build([s.block_table for s in batch.seqs], starts, batch.num_new_tokens,
                                       self.block_size, kernel=self.attn_kernel,
                                       cascade=self.attn_cascade, prefill=self.attn_prefill)
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta,
                            layer_hook)
        out: list[list[int]] = [[] for _ in batch.seqs]
        if scoring:
            self._score_prompts(hidden, batch, starts, scoring)
        if not sample_rows and not verifying:
            return out
        # NOTE: one head matmul for every row that needs logits: the head is the largest weight read of a step.
        rows = sample_rows + [r + j for i, r in verifying for j in range(len(batch.seqs[i].spec_token_ids) + 1)]
        logits = self.model.logits(hidden[rows]).float()  # [N, vocab]
        if sample_rows:
            seqs = [batch.seqs[i] for i in sampling]
            sampled = sample(logits[: len(sample_rows)], seqs, grammar_bitmask(seqs, logits.shape[-1]))
            tokens = sampled.token_ids.tolist()  # NOTE: the step's one read-back
            lps = sampled_logprobs(tokens, sampled.logprobs, sampled.logprob_token_ids,
                                   [s.params.logprobs for s in seqs])
            for i, tok, lp in zip(sampling, tokens, lps):
                out[i] = [tok]
                if lp is not None:
                    batch.seqs[i].new_logprobs.append(lp)
        first = len(sample_rows)
        for i, _ in verifying:
            seq = batch.seqs[i]
            k = len(seq.spec_token_ids)
            out[i] = verify(logits[first : first + k + 1], seq.spec_token_ids, seq.params, seq.num_output_tokens)
            first += k + 1
        return out

    def _score_prompts(self, hidden: torch.Tensor, batch: ScheduledBatch, starts: list[int],
                       scoring: list[tuple[int, int, int]]) -> None:
        """Record prompt logprobs for the positions of this step that score a prompt token (prompt_logprobs)."""
        offsets = [0]
        for n in batch.num_new_tokens:
            offsets.append(offsets[-1] + n)
        for i, first, count in scoring:
            seq = batch.seqs[i]
            flat = offsets[i] + first - starts[i]
            logits = self.model.logits(hidden[flat : flat + count])  # [count, vocab]
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)
            seq.prompt_logprobs.extend(prompt_logprobs(logits, seq.token_ids[first + 1 : first + 1 + count],
                                                       seq.params.prompt_logprobs or 0))

    @torch.inference_mode()
    def read_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of `block_ids` in `layer`: each [n, block_size, KVH, D] (int8: with the scale row)."""
        idx = torch.tensor(block_ids, dtype=torch.long)
        return self.kv[layer, 0, idx], self.kv[layer, 1, idx]  # advanced indexing copies

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K and V in every layer (a forked sequence's copy-on-write block)."""
        self.kv[:, :, dst] = self.kv[:, :, src]

    @torch.inference_mode()
    def write_blocks(self, layer: int, which: int, block_ids: list[int], kv: torch.Tensor) -> None:
        """Store K (which=0) or V (1), [n, block_size, KVH, D], into `block_ids` of `layer`."""
        self.kv[layer, which].index_copy_(0, torch.tensor(block_ids, dtype=torch.long), kv.to(self.kv_dtype))
