"""Llama-family decoder (Llama, SmolLM, Mistral; Qwen2-style q/k/v bias) over a paged KV cache.

Weights arrive in Hugging Face naming; q/k/v and gate/up are fused into single matmuls at load time.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.config import ModelConfig, RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies of RoPE, with HF's 'linear' and 'llama3' scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {scaling.rope_type!r}")


class Rotary(nn.Module):
    """Precomputed cos/sin tables; `forward` rotates q and k in place of the rotate-half convention."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x: [T, heads, D]
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP with fused projections."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.input_norm = nn.Parameter(torch.ones(d))
        self.post_attn_norm = nn.Parameter(torch.ones(d))
        self.qkv = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, d))
        self.qkv_bias = nn.Parameter(torch.zeros(self.q_size + 2 * self.kv_size)) if cfg.attention_bias else None
        self.o = nn.Parameter(torch.empty(d, self.q_size))
        self.o_bias = nn.Parameter(torch.zeros(d)) if cfg.attention_out_bias else None
        self.gate_up = nn.Parameter(torch.empty(2 * f, d))
        self.down = nn.Parameter(torch.empty(d, f))

    def forward(
        self,
        h: torch.Tensor,  # [T, d]
        positions: torch.Tensor,  # [T]
        rotary: Rotary,
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.cfg
        t = h.shape[0]
        x = F.rms_norm(h, (cfg.hidden_size,), self.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(x, self.qkv, self.qkv_bias)  # [T, (H + 2 KVH) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = rotary(q.view(t, cfg.num_heads, cfg.head_dim), positions)
        k = rotary(k.view(t, cfg.num_kv_heads, cfg.head_dim), positions)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, H, D]
        h = h + F.linear(attn.view(t, self.q_size), self.o, self.o_bias)
        x = F.rms_norm(h, (cfg.hidden_size,), self.post_attn_norm, cfg.rms_norm_eps)
        gate, up = F.linear(x, self.gate_up).chunk(2, dim=-1)  # [T, f] each
        return h + F.linear(F.silu(gate) * up, self.down)


class LlamaModel(nn.Module):
    """Embeddings → decoder layers → final norm; `logits` maps chosen hidden states to the vocabulary."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = self.embed if cfg.tie_word_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.rotary = Rotary(cfg, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, d]
        h = F.embedding(input_ids, self.embed)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = layer(h, positions, self.rotary, k_cache, v_cache, meta)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [N, d] → [N, vocab]
        h = F.rms_norm(h, (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps)
        return F.linear(h, self.lm_head)

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every expected tensor must be there."""
        w = weights
        self.embed.data = w["model.embed_tokens.weight"].to(dtype).contiguous()
        if self.cfg.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head.data = w["lm_head.weight"].to(dtype).contiguous()
        self.norm.data = w["model.norm.weight"].to(dtype)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            layer.input_norm.data = w[p + "input_layernorm.weight"].to(dtype)
            layer.post_attn_norm.data = w[p + "post_attention_layernorm.weight"].to(dtype)
            layer.qkv.data = torch.cat([w[a + n + "_proj.weight"] for n in "qkv"]).to(dtype).contiguous()
            if layer.qkv_bias is not None:
                layer.qkv_bias.data = torch.cat([w[a + n + "_proj.bias"] for n in "qkv"]).to(dtype)
            layer.o.data = w[a + "o_proj.weight"].to(dtype).contiguous()
            if layer.o_bias is not None:
                layer.o_bias.data = w[a + "o_proj.bias"].to(dtype)
            layer.gate_up.data = torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]).to(dtype).contiguous()
            layer.down.data = w[m + "down_proj.weight"].to(dtype).contiguous()
