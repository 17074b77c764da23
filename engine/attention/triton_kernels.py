"""Triton kernels for paged attention (placeholder: the kernels land in the next commit)."""

from __future__ import annotations

import torch


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, num_splits: int, scale: float, out: torch.Tensor) -> None:
    raise NotImplementedError("triton decode")


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_start: torch.Tensor,
            q_lens: torch.Tensor, ctx_lens: torch.Tensor, block_tables: torch.Tensor, max_q_len: int, scale: float,
            out: torch.Tensor) -> None:
    raise NotImplementedError("triton prefill")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    raise NotImplementedError("triton write_kv")
