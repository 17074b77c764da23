"""Hugging Face checkpoint directories (config.json + *.safetensors + tokenizer.json): read, write, and weight names."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.config import ModelConfig, RopeScaling
from engine.errors import ModelLoadError
from engine.tokenizer import Tokenizer

Weights = dict[str, torch.Tensor]

_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model of this config has, under Hugging Face Llama names, with its shape."""
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
        if config.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if config.attention_out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
    return shapes


def check_weights(config: ModelConfig, weights: Weights, source: str) -> None:
    """Raise ModelLoadError unless `weights` has exactly the names and shapes the config implies."""
    shapes = expected_shapes(config)
    missing, unexpected = sorted(shapes.keys() - weights.keys()), sorted(weights.keys() - shapes.keys())
    if missing or unexpected:
        raise ModelLoadError("model", f"{source}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    for name, shape in shapes.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError("model", f"{source}: {name} has shape {tuple(weights[name].shape)}, expected {shape}")


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelLoadError("model", f"cannot read {path}: {e}") from e


def _rope_scaling(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # NOTE: transformers < 5 writes rope_theta + rope_scaling; transformers 5 writes both into rope_parameters.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", factor=float(scaling["factor"]))
    if kind == "llama3":
        return theta, RopeScaling("llama3", factor=float(scaling["factor"]),
                                  low_freq_factor=float(scaling["low_freq_factor"]),
                                  high_freq_factor=float(scaling["high_freq_factor"]),
                                  original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))
    raise ModelLoadError("model", f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


def _ids(*values: Any) -> tuple[int, ...]:
    out: list[int] = []
    for v in values:
        for i in v if isinstance(v, list) else [] if v is None else [v]:
            if int(i) not in out:
                out.append(int(i))
    return tuple(out)


def config_from_hf(cfg: dict[str, Any], gen: dict[str, Any], *, name: str, model_id: str) -> ModelConfig:
    """ModelConfig from the dicts of config.json and generation_config.json."""
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if missing := [k for k in required if not isinstance(cfg.get(k), int)]:
        raise ModelLoadError("model", f"config.json lacks integer fields {missing}")
    arch = next((_ARCHITECTURES[a] for a in cfg.get("architectures") or [] if a in _ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError("model", f"unsupported architectures {cfg.get('architectures')}; "
                                      f"supported: {sorted(_ARCHITECTURES)}")
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ModelLoadError("model", f"num_attention_heads {heads} not a multiple of num_key_value_heads {kv_heads}")
    theta, scaling = _rope_scaling(cfg)
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    window = cfg.get("sliding_window") if arch == "mistral" or cfg.get("use_sliding_window") else None
    if window:
        # NOTE: we do not implement sliding-window attention; inside the window full attention is exact.
        max_pos = min(max_pos, int(window))
    bias = bool(cfg.get("attention_bias", arch == "qwen2"))
    return ModelConfig(
        name=name, model_id=model_id, vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
        rope_theta=theta, rope_scaling=scaling, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v bias and never an o_proj bias; Llama's attention_bias covers all four.
        attention_bias=True if arch == "qwen2" else bias, attention_out_bias=False if arch == "qwen2" else bias,
        bos_token_id=next(iter(_ids(gen.get("bos_token_id"), cfg.get("bos_token_id"))), None),
        eos_token_ids=_ids(gen.get("eos_token_id"), cfg.get("eos_token_id")))


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError("model", f"no *.safetensors weights in {path}")
    return [os.path.join(path, f) for f in files]


def hf_model_id(path: str, prefix: str) -> str:
    """f"{prefix}-{12 hex}" of a sha256 over config.json and every weight file's bytes (independent of `path`)."""
    # NOTE: full contents, not sizes: two fine-tunes of one architecture have identical names and sizes, and
    # sharing KV blocks between them would be silently wrong. Hashing runs at ~1 GB/s, well below the load cost.
    digest = hashlib.sha256()
    for file in [os.path.join(path, "config.json"), *_weight_files(path)]:
        digest.update(os.path.basename(file).encode() + b"\0")
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return f"{prefix}-{digest.hexdigest()[:12]}"


def load_hf_dir(path: str, name: str, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Config, weights (floating ones in `dtype`, all on `device`) and tokenizer of a Hugging Face checkpoint
    directory; read tensor by tensor, so no float32 copy of a bf16 model is ever built on the host."""
    cfg = _read_json(os.path.join(path, "config.json"))
    gen_file = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_file) if os.path.isfile(gen_file) else {}
    tokenizer = Tokenizer.from_hf_dir(path)
    config = config_from_hf(cfg, gen, name=name, model_id=hf_model_id(path, str(cfg.get("model_type", "hf"))))
    if not config.eos_token_ids and tokenizer.eos_token_id is not None:
        config = replace(config, eos_token_ids=(tokenizer.eos_token_id,))
    weights: Weights = {}
    for file in _weight_files(path):
        try:
            # NOTE: a CUDA target reads each tensor straight onto the GPU (then converts it there)
            where = str(device) if torch.device(device).type == "cuda" else "cpu"
            with safe_open(file, framework="pt", device=where) as f:
                for key in f.keys():
                    if key.endswith("rotary_emb.inv_freq"):  # recomputed from the config; old checkpoints saved it
                        continue
                    t = f.get_tensor(key)
                    weights[key] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype).contiguous()
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error type for a truncated or garbled file
            raise ModelLoadError("model", f"cannot read {file}: {e}") from e
    if config.tie_word_embeddings:
        # NOTE: some tied checkpoints also save lm_head.weight (a copy of the embeddings); it is redundant.
        weights.pop("lm_head.weight", None)
    check_weights(config, weights, path)
    return config, weights, tokenizer


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """config.json contents for `config` (LlamaForCausalLM, or Qwen2ForCausalLM for q/k/v-only bias)."""
    if config.attention_out_bias and not config.attention_bias:
        raise ModelLoadError("model", "an o_proj bias without q/k/v bias has no Hugging Face architecture")
    qwen2 = config.attention_bias and not config.attention_out_bias
    cfg: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": None,
        "tie_word_embeddings": config.tie_word_embeddings, "bos_token_id": config.bos_token_id,
        "eos_token_id": list(config.eos_token_ids), "torch_dtype": "float32",
    }
    if qwen2:
        cfg |= {"use_sliding_window": False, "sliding_window": None}
    else:
        cfg |= {"attention_bias": config.attention_bias, "mlp_bias": False}
    if (s := config.rope_scaling) is not None:
        cfg["rope_scaling"] = {"rope_type": s.rope_type, "factor": s.factor}
        if s.rope_type == "llama3":
            cfg["rope_scaling"] |= {"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                                    "original_max_position_embeddings": s.original_max_position_embeddings}
    return cfg


def save_hf_dir(config: ModelConfig, weights: Weights, tokenizer: Tokenizer, path: str) -> None:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files into `path`."""
    check_weights(config, weights, "save_hf_dir")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config_dict(config), f, indent=2)
    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}, f, indent=2)
    # NOTE: an engine built on these weights made its fused q/k/v and gate/up the dict's storage (engine/model.py:
    # views of one tensor), which safetensors refuses to write as separate tensors
    save_file({k: v.clone() if v._base is not None else v.contiguous() for k, v in weights.items()},
              os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    tokenizer.save_hf(path)
