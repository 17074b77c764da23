"""LoRA adapters in PEFT's format (adapter_config.json + adapter_model.safetensors), checked against the base model.

An adapter becomes, per decoder layer, a (A, B) pair for each of the layer's fused linears that it targets: for the
fused q/k/v (and gate/up) the parts' A are stacked and B is block-diagonal, so one matmul pair serves the fused
layer. B carries the scale (lora_alpha / r, or / sqrt(r) with use_rslora): delta = x @ A.T @ B.T.
Anything we cannot serve exactly (a rank over max_lora_rank, a wrong shape, an unknown target, DoRA, trained biases,
extra saved modules) is refused with LoRALoadError naming what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.errors import ModelLoadError

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# target module → (the fused linear of DecoderLayer it adds to, its part's index in that linear's output)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
LINEARS = ("qkv", "o", "gate_up", "down")
# NOTE: PEFT saves `base_model.model.<the model's own names>.lora_A.weight`; older files keep the adapter's name
# (`lora_A.default.weight`); both are accepted, with or without the wrapper prefixes.
_KEY = re.compile(r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.default)?\.weight")


class LoRALoadError(ModelLoadError):
    """An adapter could not be loaded; the message names the adapter and what is wrong with it."""


@dataclass(frozen=True)
class LoRAPair:
    """One fused linear's low-rank update: delta = x @ a.T @ b.T (the scale is in b)."""

    a: torch.Tensor  # [R, in], R = the sum of the targeted parts' ranks
    b: torch.Tensor  # [out, R], block-diagonal over the parts (zeros where a part is not targeted)
    ranks: tuple[tuple[int, int], ...] = ()  # (part index, its rank) of each targeted part, in R's order


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter: its name, cache key and per-layer pairs (None where it does not touch a linear)."""

    name: str
    key: str  # NOTE: name + a digest of its files: the block-hash extra key, so reloading other weights never hits
    rank: int  # the largest rank of its modules
    layers: list[dict[str, LoRAPair]]  # per decoder layer: linear name ("qkv", "o", "gate_up", "down") → pair


def part_sizes(cfg: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """Per fused linear, its parts' (out, in) in output order."""
    d, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {"qkv": [(q, d), (kv, d), (kv, d)], "o": [(d, q)], "gate_up": [(f, d), (f, d)], "down": [(d, f)]}


def load_adapter(name: str, path: str, cfg: ModelConfig, max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoRAAdapter:
    """Read and check a PEFT adapter directory; LoRALoadError naming the problem."""
    def fail(reason: str) -> LoRALoadError:
        return LoRALoadError("lora", f"adapter {name!r} ({path}): {reason}")

    config_path, weights_path = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            raise fail(f"missing file {os.path.basename(p)} (a PEFT adapter directory holds {CONFIG_FILE} and "
                       f"{WEIGHTS_FILE})")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise fail(f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise fail(f"{CONFIG_FILE} must hold a JSON object")
    scale = _scale(config, fail)
    try:
        from safetensors.torch import load_file

        tensors = load_file(weights_path)
    except Exception as e:  # NOTE: safetensors raises its own error types for a truncated or foreign file
        raise fail(f"{WEIGHTS_FILE} cannot be read: {e}") from None
    pairs = _pairs(tensors, cfg, max_rank, fail)
    layers: list[dict[str, LoRAPair]] = [{} for _ in range(cfg.num_layers)]
    sizes = part_sizes(cfg)
    for (layer, linear), parts in pairs.items():
        a_parts, b_blocks = [], []
        for index in sorted(parts):  # NOTE: in output order, so A's rows and B's columns follow the parts
            a, b = parts[index]
            a_parts.append(a)
            b_blocks.append((index, b))
        total = sum(a.shape[0] for a in a_parts)
        b_full = torch.zeros(sum(out for out, _ in sizes[linear]), total)  # [out, R]
        offsets = [sum(out for out, _ in sizes[linear][:i]) for i in range(len(sizes[linear]))]
        col = 0
        for index, b in b_blocks:
            b_full[offsets[index]: offsets[index] + b.shape[0], col: col + b.shape[1]] = b.float() * scale
            col += b.shape[1]
        a_cat = torch.cat([a.float() for a in a_parts])
        layers[layer][linear] = LoRAPair(a_cat.to(device, dtype).contiguous(), b_full.to(device, dtype).contiguous(),
                                         tuple((index, b.shape[1]) for index, b in b_blocks))
    digest = hashlib.sha256()
    for p in (config_path, weights_path):
        with open(p, "rb") as fh:
            digest.update(hashlib.sha256(fh.read()).digest())
    rank = max(a.shape[0] for parts in pairs.values() for a, _ in parts.values())
    return LoRAAdapter(name, f"lora:{name}:{digest.hexdigest()[:16]}", rank, layers)


def _scale(config: dict, fail: Callable[[str], LoRALoadError]) -> float:
    """lora_alpha / r (PEFT's scaling), or / sqrt(r) with use_rslora; unsupported options refused."""
    if config.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type {config.get('peft_type')!r} is not LORA")
    for option in ("use_dora", "fan_in_fan_out"):  # NOTE: fan_in_fan_out: GPT-2's transposed Conv1D weights
        if config.get(option):
            raise fail(f"{option} is not supported")
    if config.get("bias", "none") != "none":
        raise fail(f"bias {config.get('bias')!r} is not supported (only 'none': no trained biases)")
    if config.get("modules_to_save"):
        raise fail(f"modules_to_save {config.get('modules_to_save')!r} is not supported")
    for option in ("rank_pattern", "alpha_pattern"):
        if config.get(option):
            raise fail(f"{option} is not supported (one r and lora_alpha for every module)")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise fail(f"unknown target module(s) {unknown}; supported: {list(TARGETS)}")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise fail(f"r must be a positive integer in {CONFIG_FILE}, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise fail(f"lora_alpha must be a number in {CONFIG_FILE}, got {alpha!r}")
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)


def _pairs(tensors: dict[str, torch.Tensor], cfg: ModelConfig, max_rank: int,
           fail: Callable[[str], LoRALoadError]) -> dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """(layer, fused linear) → part index → (A [r, in], B [out, r]), every shape checked."""
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise fail(f"unexpected tensor {key!r} (expected layers.N.self_attn|mlp.<target>.lora_A|lora_B.weight)")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGETS:
            raise fail(f"unknown target module {module!r} in {key!r}; supported: {list(TARGETS)}")
        if layer >= cfg.num_layers:
            raise fail(f"{key!r}: layer {layer} but the model has {cfg.num_layers} layers")
        found.setdefault((layer, module), {})[which] = t
    if not found:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA weights")
    sizes = part_sizes(cfg)
    out: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in sorted(found.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise fail(f"{where} has lora_{'A' if 'B' in ab else 'B'} missing")
        a, b = ab["A"], ab["B"]
        linear, index = TARGETS[module]
        out_features, in_features = sizes[linear][index]
        if a.dim() != 2 or b.dim() != 2:
            raise fail(f"{where}: lora_A and lora_B must be matrices, got {list(a.shape)} and {list(b.shape)}")
        r = a.shape[0]
        if r > max_rank:
            raise fail(f"{where}: rank {r} exceeds max_lora_rank {max_rank}")
        if list(a.shape) != [r, in_features] or list(b.shape) != [out_features, r]:
            raise fail(f"{where}: wrong shapes lora_A {list(a.shape)}, lora_B {list(b.shape)}; the base model "
                       f"needs [r, {in_features}] and [{out_features}, r]")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise fail(f"{where}: weights must be floating point, got {a.dtype} and {b.dtype}")
        out.setdefault((layer, linear), {})[index] = (a, b)
    return out
