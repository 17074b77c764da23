"""LoRA test builders: random adapters written in PEFT's format (no model hub), and the reference they are held to
(the base model with the adapter's update merged into its weights, computed here from the files as PEFT does)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import torch
from safetensors.torch import load_file, save_file

from engine.loader import LoadedModel

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTN = {"q_proj", "k_proj", "v_proj", "o_proj"}


def module_shape(loaded: LoadedModel, module: str) -> tuple[int, int]:
    """(out, in) of a target module of the base model."""
    part = "self_attn" if module in _ATTN else "mlp"
    return tuple(loaded.weights[f"model.layers.0.{part}.{module}.weight"].shape)  # type: ignore[return-value]


def make_adapter(path: str, loaded: LoadedModel, *, rank: int = 8, alpha: float = 16.0,
                 targets: tuple[str, ...] = ALL_TARGETS, seed: int = 0, strength: float = 1.0,
                 key_style: str = "peft", layers: list[int] | None = None,
                 config_extra: dict | None = None) -> str:
    """A random PEFT adapter directory at `path` (adapter_config.json + adapter_model.safetensors); returns path.

    `strength` scales the update against the base weights (1: about as large as them); `key_style` "peft" names
    tensors `base_model.model.model.layers.N...lora_A.weight`, "default" adds PEFT's older `.default`.
    """
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(loaded.config.num_layers) if layers is None else layers:
        for module in targets:
            out, inp = module_shape(loaded, module)
            part = "self_attn" if module in _ATTN else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tail = ".default.weight" if key_style == "default" else ".weight"
            # NOTE: |B A x| ~ strength |W x| with the scale alpha / rank applied
            tensors[f"{stem}.lora_A{tail}"] = torch.randn(rank, inp, generator=g) / inp**0.5
            tensors[f"{stem}.lora_B{tail}"] = torch.randn(out, rank, generator=g) * strength / (alpha / rank) / \
                rank**0.5 / inp**0.5
    os.makedirs(path, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", "base_model_name_or_path": loaded.config.name, "task_type": "CAUSAL_LM"}
    config.update(config_extra or {})
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    return path


def merged_model(loaded: LoadedModel, path: str) -> LoadedModel:
    """The base model with the adapter at `path` merged in: W + lora_alpha / r * B @ A (PEFT's merge), float32."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        config = json.load(f)
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
    weights = {k: w.clone() for k, w in loaded.weights.items()}
    for key, a in tensors.items():
        if ".lora_A" not in key:
            continue
        b = tensors[key.replace(".lora_A", ".lora_B")]
        name = re.sub(r"\.lora_A(\.default)?\.weight$", ".weight", key.removeprefix("base_model.model."))
        weights[name] = weights[name] + scale * (b.double() @ a.double()).float()
    config_ = dataclasses.replace(loaded.config, model_id=loaded.config.model_id + "-merged")
    return LoadedModel(config_, weights, loaded.tokenizer)


def rewrite(path: str, *, drop: str | None = None, replace: dict[str, torch.Tensor] | None = None) -> None:
    """Edit an adapter's weights file in place: drop the tensors whose name contains `drop`, replace others."""
    file = os.path.join(path, "adapter_model.safetensors")
    tensors = load_file(file)
    if drop is not None:
        tensors = {k: v for k, v in tensors.items() if drop not in k}
    tensors.update(replace or {})
    save_file(tensors, file)
