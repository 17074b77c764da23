"""Megatron-style sharding of a Llama-family decoder's weights for one rank of a tensor-parallel group.

A rank's shard is the model's weights under the same Hugging Face names, cut as a TP n rank computes with them, so
the unchanged `LlamaModel` runs on a rank's config (`rank_config`: its heads and MLP width):
- q/k/v and gate/up are column parallel (split by output rows): rank r keeps q heads [r H/n, (r+1) H/n) and the KV
  heads those query heads read; `DecoderLayer` then fuses each rank's q|k|v and gate|up parts, so the fused weight
  is sharded per part (a cut of the fused matrix would give rank 0 all of q and none of v);
- o and down are row parallel (split by input columns): each rank's product is a partial sum, all-reduced after the
  layer (engine/parallel/group.py `RowParallel`); o's bias is added once (rank 0's; zeros elsewhere);
- KV heads: KVH/n per rank when n divides KVH; when n > KVH each KV head is replicated on the n/KVH ranks whose
  query heads read it;
- the LM head is split by vocabulary rows (`vocab_rows`: ceil(V/n) per rank, the last one short): each rank
  computes its columns of the logits, gathered on rank 0 (engine/parallel/group.py `VocabParallelHead`); a tied
  head's rows are cut from the embedding;
- the embedding and the norms are replicated (see engine/parallel/__init__.py for why).
"""

from __future__ import annotations

import dataclasses

import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequestError

FIELD = "tensor_parallel_size"


def check_tp(cfg: ModelConfig, n: int) -> None:
    """Refuse, naming `tensor_parallel_size`, a TP size the model's head counts or MLP width cannot be split by."""
    if n == 1:
        return
    if cfg.num_heads % n:
        raise InvalidRequestError(FIELD, f"{n} must divide the model's {cfg.num_heads} attention heads ({cfg.name})")
    kvh = cfg.num_kv_heads
    if (n <= kvh and kvh % n) or (n > kvh and n % kvh):
        raise InvalidRequestError(FIELD, f"{n} must divide the model's {kvh} KV heads, or be a multiple of them "
                                  f"(then each KV head is replicated) ({cfg.name})")
    if cfg.intermediate_size % n:
        raise InvalidRequestError(FIELD, f"{n} must divide the model's MLP width {cfg.intermediate_size} ({cfg.name})")


def rank_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The architecture one rank of TP n computes: H/n query heads, max(1, KVH/n) KV heads, MLP width I/n (n = 1:
    `cfg` itself)."""
    if n == 1:
        return cfg
    check_tp(cfg, n)
    # NOTE: untied: a rank's head is its own slice of the vocabulary (`shard_weights`), not the embedding it looks
    # ids up in
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=max(1, cfg.num_kv_heads // n),
                               intermediate_size=cfg.intermediate_size // n, tie_word_embeddings=False)


def vocab_rows(vocab: int, rank: int, n: int) -> range:
    """The LM head rows (vocabulary ids) rank `rank` of TP n computes logits for: ceil(V/n) each, the last rank's
    fewer when n does not divide V."""
    chunk = -(-vocab // n)
    return range(min(vocab, rank * chunk), min(vocab, (rank + 1) * chunk))


def kv_heads_of(cfg: ModelConfig, rank: int, n: int) -> range:
    """The KV heads rank `rank` of TP n holds (one replicated head when n > KVH)."""
    kvh = cfg.num_kv_heads
    if n <= kvh:
        per = kvh // n
        return range(rank * per, (rank + 1) * per)
    head = rank // (n // kvh)  # NOTE: its query heads [r H/n, (r+1) H/n) all read this KV head
    return range(head, head + 1)


def _rows(t: torch.Tensor, heads: range, head_dim: int) -> torch.Tensor:
    """The rows of heads `heads` of a [heads * D, ...] weight (or [heads * D] bias)."""
    return t[heads.start * head_dim : heads.stop * head_dim].contiguous()


def shard_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], rank: int,
                  n: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s shard of `weights` (HF names, full model) for TP n: new tensors for the split ones, the
    replicated ones as they are (no copy); `lm_head.weight` is always there (n > 1), tied or not: the rank's
    vocabulary rows (`vocab_rows`)."""
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is not in a group of {n}")
    check_tp(cfg, n)
    d = cfg.head_dim
    q_heads = range(rank * cfg.num_heads // n, (rank + 1) * cfg.num_heads // n)
    kv_heads = kv_heads_of(cfg, rank, n)
    width = cfg.intermediate_size // n
    cols = slice(rank * width, (rank + 1) * width)
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        part = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if part == "q_proj":
            out[name] = _rows(w, q_heads, d)
        elif part in ("k_proj", "v_proj"):
            out[name] = _rows(w, kv_heads, d)
        elif part == "o_proj" and name.endswith(".weight"):
            out[name] = w[:, q_heads.start * d : q_heads.stop * d].contiguous()  # [d_model, H/n * D]
        elif part == "o_proj":  # the bias: added once, after the all-reduce's sum
            out[name] = w if rank == 0 else torch.zeros_like(w)
        elif part in ("gate_proj", "up_proj"):
            out[name] = w[cols].contiguous()  # [I/n, d_model]
        elif part == "down_proj":
            out[name] = w[:, cols].contiguous()  # [d_model, I/n]
        elif name == "lm_head.weight":
            out[name] = w[_span(vocab_rows(cfg.vocab_size, rank, n))].contiguous()  # [ceil(V/n) or fewer, d_model]
        else:  # embedding, norms: replicated
            out[name] = w
    if n > 1 and cfg.tie_word_embeddings:
        out["lm_head.weight"] = weights["model.embed_tokens.weight"][
            _span(vocab_rows(cfg.vocab_size, rank, n))].contiguous()
    return out


def _span(r: range) -> slice:
    return slice(r.start, r.stop)
