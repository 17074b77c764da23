"""Llama-family decoder (Llama, SmolLM, Mistral; Qwen2-style q/k/v bias) over a paged KV cache.

Inference only: weights arrive in Hugging Face naming and are frozen (fused and packed) at load time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

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
    """Precomputed cos/sin tables (rotate-half convention); `rotation` makes one step's rotation of q and k.

    NOTE: built on the model's device at load, so a step reads them with an on-device gather (no host tensor).
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, device: torch.device | str = "cpu",
                 triton: bool = False) -> None:
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, device)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.cos, self.sin = emb.cos(), emb.sin()
        self.kernel: Callable[..., None] | None = None  # engine/triton_ops.py's rotary (with the KV write)
        if triton:
            from engine import triton_ops

            self.kernel = triton_ops.rotary_

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for these positions, [T, 1, D] each."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    def rotation(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation of one step (made once per step, used by every layer)."""
        return Rotation(self, positions, dtype)


class Rotation:
    """One step's rotary at `positions`: the Triton kernel in place with the KV write fused in, or the torch ops over
    the gathered table rows and then the backend's write."""

    def __init__(self, rotary: Rotary, positions: torch.Tensor, dtype: torch.dtype) -> None:
        self.rotary, self.positions = rotary, positions
        self.cos_sin = None if rotary.kernel is not None else rotary.at(positions, dtype)

    def rotate_and_write(self, qk: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate qk [T, H + KVH, D] (q heads, then k) and store k and v ([T, KVH, D]) into the caches (the
        backend's write); returns q and k ([T, H, D], [T, KVH, D], views)."""
        heads = qk.shape[1] - v.shape[1]
        if self.cos_sin is not None:
            qk = apply_rotary(qk, *self.cos_sin)
            write_kv(k_cache, v_cache, qk[:, heads:], v, meta)
        else:
            assert self.rotary.kernel is not None
            self.rotary.kernel(qk, self.positions, self.rotary.cos, self.rotary.sin, v, k_cache, v_cache,
                               meta.slot_mapping)
        return qk[:, :heads], qk[:, heads:]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # x: [T, heads, D]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(r) * weight, r) for r = x or x + delta: the residual stream's add and the next norm (torch ops)."""
    r = x if delta is None else x + delta
    return F.rms_norm(r, (r.shape[-1],), weight, eps), r


def silu_mul(x: torch.Tensor) -> torch.Tensor:  # [T, 2f] (gate, up) -> [T, f]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class PointwiseOps(NamedTuple):
    """The layer's norm (with the residual add) and activation: torch ops, or engine/triton_ops.py's kernels."""

    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]


def pointwise_ops(triton: bool) -> PointwiseOps:
    """The Triton kernels for the Triton backend (CUDA, or the interpreter in tests), else the torch ops."""
    if not triton:
        return PointwiseOps(rms_norm, silu_mul)
    from engine import triton_ops

    return PointwiseOps(triton_ops.rms_norm, triton_ops.silu_mul)


class DecoderLayer:
    """Pre-norm attention + SwiGLU MLP; q/k/v and gate/up are fused into single (packed) matmuls."""

    def __init__(self, cfg: ModelConfig, w: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype,
                 quantization: str | None = None, device: torch.device | str = "cpu",
                 ops: PointwiseOps | None = None) -> None:
        self.cfg = cfg
        self.ops = ops or pointwise_ops(False)
        linear = make_linear(quantization)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        a, m = prefix + "self_attn.", prefix + "mlp."

        def get(name: str) -> torch.Tensor:
            return w[name].to(device=device, dtype=dtype).contiguous()

        def fused(names: list[str]) -> torch.Tensor:
            """The weights `names` concatenated. Where the dict's own tensors were used as they are (already on the
            device, in the dtype), its entries become views of the result and the originals are freed: kept, they
            would be a second copy of most of the model for the engine's life (on a GPU, memory the KV pool sized
            by gpu_memory_utilization does not get: ~9 GB of an 8B model in bf16)."""
            parts = [get(n) for n in names]
            out = torch.cat(parts)
            if all(part is w[n] for part, n in zip(parts, names)):
                w.update(zip(names, out.split([part.shape[0] for part in parts])))
            return out

        self.input_norm = get(prefix + "input_layernorm.weight")
        self.post_attn_norm = get(prefix + "post_attention_layernorm.weight")
        qkv_bias = fused([a + n + "_proj.bias" for n in "qkv"]) if cfg.attention_bias else None
        self.qkv = linear(fused([a + n + "_proj.weight" for n in "qkv"]), qkv_bias)
        self.o = linear(get(a + "o_proj.weight"), get(a + "o_proj.bias") if cfg.attention_out_bias else None)
        self.gate_up = linear(fused([m + "gate_proj.weight", m + "up_proj.weight"]))
        self.down = linear(get(m + "down_proj.weight"))

    def __call__(
        self,
        h: torch.Tensor,  # [T, d]: the last layer's MLP output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # [T, d]: the residual stream before h is added (None for layer 0)
        rotation: Rotation,  # this step's rotary (Rotary.rotation)
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] (int8 KV: see engine/kv_quant.py)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's MLP output, the residual stream before it)
        cfg = self.cfg
        t = h.shape[0]
        norm, eps = self.ops.rms_norm, cfg.rms_norm_eps
        # NOTE: the residual adds are fused into the norms that follow them (one kernel each on the Triton path)
        x, residual = norm(h, self.input_norm, eps) if residual is None else norm(residual, self.input_norm, eps, h)
        qk, v = self.qkv(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)  # [T, (H + 2 KVH) D]
        # NOTE: one rotary over q and k together (the same per-element math as two calls, half the ops per layer),
        # then the backend's KV write; q [T, H, D], k [T, KVH, D] (strided views)
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = rotation.rotate_and_write(qk.view(t, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), v, k_cache,
                                         v_cache, meta)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, H, D]
        x, residual = norm(residual, self.post_attn_norm, eps, self.o(attn.view(t, self.q_size)))
        return self.down(self.ops.silu_mul(self.gate_up(x))), residual


class LlamaModel:
    """Embeddings → decoder layers → final norm; `logits` maps chosen hidden states to the vocabulary.

    Built from Hugging Face-named weights; every expected tensor must be there. `quantization="int8"` stores the
    linear layers and the head as int8 (the embedding table stays in `dtype`: a lookup reads one row per token).
    Every weight and table lives on `device`; weights already there in `dtype` are used as they are (no copy).
    `triton`: the pointwise work (norms, activation, rotary) in engine/triton_ops.py's kernels (the Triton backend).
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 max_positions: int, quantization: str | None = None, device: torch.device | str = "cpu",
                 triton: bool = False) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.ops = pointwise_ops(triton)
        self.embed = weights["model.embed_tokens.weight"].to(device=device, dtype=dtype).contiguous()  # [vocab, d]
        self.layers = [DecoderLayer(cfg, weights, f"model.layers.{i}.", dtype, quantization, device, self.ops)
                       for i in range(cfg.num_layers)]
        self.norm = weights["model.norm.weight"].to(device=device, dtype=dtype)
        # NOTE: a tied head gets its own packed copy: the packed layout cannot serve embedding lookups.
        head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"].to(
            device=device, dtype=dtype).contiguous()
        self.lm_head = make_linear(quantization)(head)
        self.rotary = Rotary(cfg, max_positions, device, triton)

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        layer_hook: Callable[[int], None] | None = None,  # called after each layer wrote its K/V
    ) -> torch.Tensor:  # [T, d]
        h = F.embedding(input_ids, self.embed)
        rotation = self.rotary.rotation(positions, h.dtype)
        residual: torch.Tensor | None = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(h, residual, rotation, k_cache, v_cache, meta)
            if layer_hook is not None:
                layer_hook(i)
        return h if residual is None else residual + h

    def logits(self, h: torch.Tensor) -> torch.Tensor:  # [N, d] → [N, vocab]
        return self.lm_head(self.ops.rms_norm(h, self.norm, self.cfg.rms_norm_eps)[0])
