"""Llama-family decoder (Llama, SmolLM, Mistral; Qwen2-style q/k/v bias) over a paged KV cache.

Inference only: weights arrive in Hugging Face naming and are frozen (fused and packed) at load time.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.config import ModelConfig, RopeScaling
from engine.linear import make_linear


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies of RoPE, with HF's 'linear' and 'llama3' scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
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


class Rotary:
    """Precomputed cos/sin tables (rotate-half convention); `at` picks the rows of one step's positions.

    NOTE: built on the model's device at load, so a step reads them with an on-device gather (no host tensor).
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str = "cpu") -> None:
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos(), emb.sin()

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, [T, 1, D] each (computed once per step, shared by all layers)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x: [T, heads, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DecoderLayer:
    """Pre-norm attention + SwiGLU MLP; q/k/v and gate/up are fused into single (packed) matmuls."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype,
                 quantization: str | None = None, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        linear = make_linear(quantization)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        a, m = prefix + "self_attn.", prefix + "mlp."

        def get(name: str) -> torch.Tensor:
            return w[name].to(device=device, dtype=dtype).contiguous()

        self.input_norm = get(prefix + "input_layernorm.weight")
        self.post_attn_norm = get(prefix + "post_attention_layernorm.weight")
        qkv_bias = torch.cat([get(a + n + "_proj.bias") for n in "qkv"]) if cfg.attention_bias else None
        self.qkv = linear(torch.cat([get(a + n + "_proj.weight") for n in "qkv"]), qkv_bias)
        self.o = linear(get(a + "o_proj.weight"), get(a + "o_proj.bias") if cfg.attention_out_bias else None)
        self.gate_up = linear(torch.cat([get(m + "gate_proj.weight"), get(m + "up_proj.weight")]))
        self.down = linear(get(m + "down_proj.weight"))

    def __call__(
        self,
        h: torch.Tensor,  # [T, d]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] (int8 KV: see engine/kv_quant.py)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.cfg
        t = h.shape[0]
        x = F.rms_norm(h, (cfg.hidden_size,), self.input_norm, cfg.rms_norm_eps)
        qk, v = self.qkv(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)  # [T, (H + 2 KVH) D]
        # NOTE: one rotary over q and k together (the same per-element math as two calls, half the ops per layer)
        qk = apply_rotary(qk.view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), *rope)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)  # [T, H, D], [T, KVH, D] (strided views)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        write_kv(k_cache, v_cache, k, v, meta)  # the backend's write (a Triton kernel on CUDA)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, H, D]
        h = h + self.o(attn.view(t, self.q_size))
        x = F.rms_norm(h, (cfg.hidden_size,), self.post_attn_norm, cfg.rms_norm_eps)
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [T, f] each
        return h + self.down(F.silu(gate) * up)


class LlamaModel:
    """Embeddings → decoder layers → final norm; `logits` maps chosen hidden states to the vocabulary.

    Built from Hugging Face-named weights; every expected tensor must be there. `quantization="int8"` stores the
    linear layers and the head as int8 (the embedding table stays in `dtype`: a lookup reads one row per token).
    Every weight and table lives on `device`; weights already there in `dtype` are used as they are (no copy).
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_positions: int, quantization: str | None = None, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.embed = weights["model.embed_tokens.weight"].to(device=device, dtype=dtype).contiguous()  # [vocab, d]
        self.layers = [DecoderLayer(cfg, weights, f"model.layers.{i}.", dtype, quantization, device)
                       for i in range(cfg.num_layers)]
        self.norm = weights["model.norm.weight"].to(device=device, dtype=dtype)
        # NOTE: a tied head gets its own packed copy: the packed layout cannot serve embedding lookups.
        head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"].to(
            device=device, dtype=dtype).contiguous()
        self.lm_head = make_linear(quantization)(head)
        self.rotary = Rotary(cfg, max_positions, device)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,  # called after each layer wrote its K/V
    ) -> torch.Tensor:  # [T, d]
        h = F.embedding(input_ids, self.embed)
        rope = self.rotary.at(positions, h.dtype)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            h = layer(h, rope, k_cache, v_cache, meta)
            if layer_hook is not None:
                layer_hook(i)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [N, d] → [N, vocab]
        return self.lm_head(F.rms_norm(h, (self.cfg.hidden_size,), self.norm, self.cfg.rms_norm_eps))
