"""Model architecture (read from the weights) and engine settings (chosen by the user)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch  # NOTE: imported where a dtype or device is resolved: the router validates configs without torch


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as in HF `rope_scaling` ("linear" or "llama3")."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM, Qwen2-style q/k/v bias)."""

    name: str
    # NOTE: model_id scopes prefix-cache block hashes; two engines share KV only if their ids match.
    model_id: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Qwen2-style bias on q/k/v; Llama's `attention_bias` also puts one on o_proj.
    attention_bias: bool = False
    attention_out_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"


def _positive(name: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise InvalidRequestError(name, f"must be > 0, got {value}")


SPECULATIVE_METHODS = ("ngram",)
QUANTIZATIONS = ("int8",)
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding as vLLM names it; only n-gram prompt lookup ("ngram") is implemented."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # draft tokens proposed (and verified in one step) per sequence
    prompt_lookup_max: int = 4  # longest n-gram matched against the prompt and the output so far
    prompt_lookup_min: int = 1  # shortest n-gram tried before giving up on a draft

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidRequestError("speculative_config.method", f"use one of {SPECULATIVE_METHODS}, "
                                      f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidRequestError(f"speculative_config.{name}", f"must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError("speculative_config.prompt_lookup_min",
                                      f"{self.prompt_lookup_min} exceeds prompt_lookup_max {self.prompt_lookup_max}")

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, object] | None) -> SpeculativeConfig | None:
        """A config from vLLM's dict form (`{"method": "ngram", ...}`), unknown keys refused."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        unknown = sorted(set(value) - {f.name for f in fields(cls)})
        if unknown:
            raise InvalidRequestError("speculative_config", f"unknown key(s) {unknown}")
        return cls(**value)  # type: ignore[arg-type]


@dataclass
class EngineConfig:
    """Settings of one engine instance; None means 'derive a sensible default'."""

    block_size: int = 16
    # NOTE: None sizes the pool from kv_cache_memory_gb; an explicit count wins.
    num_blocks: int | None = None
    # The KV pool's size when num_blocks is None. None: 1 GiB on the CPU; on CUDA the pool is sized by
    # gpu_memory_utilization instead (a set size wins there, as vLLM's kv_cache_memory_bytes does; then
    # gpu_memory_utilization may not be set too).
    kv_cache_memory_gb: float | None = None
    max_num_seqs: int = 64
    # Cap on tokens computed per step (prefill chunks + one per decoding sequence).
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    # "auto": bfloat16 on CUDA, float32 on the CPU; or "float32", "bfloat16", "float16".
    dtype: str = "auto"
    # Where the engine computes: "cpu", "cuda" (the current device: in a Ray actor with num_gpus, the GPU Ray gave
    # it) or "cuda:N". CUDA without a usable GPU is refused at load (`resolved_device`).
    device: str = "cpu"
    # CUDA only (vLLM's meaning): the fraction of the GPU's total memory for weights, activations and KV; the KV pool
    # gets what is left after a profiling forward pass of max_num_batched_tokens. None: 0.9 on CUDA. An explicit
    # num_blocks or kv_cache_memory_gb wins. On the CPU the pool is sized by kv_cache_memory_gb.
    gpu_memory_utilization: float | None = None
    # CUDA only (vLLM's name): True runs every step eagerly; False captures decode-only steps as CUDA graphs.
    enforce_eager: bool = False
    # With CUDA graphs: launch the next decode step before this step's sampled ids reach the host, so the GPU never
    # waits for the host's scheduling and output work between two steps (engine/step.py, `Lookahead`; the
    # overlap vLLM's async scheduling and SGLang's overlap scheduler make). False: one step at a time.
    decode_lookahead: bool = True
    num_threads: int | None = None
    enable_prefix_caching: bool = True
    # Order of prompt work in a step: "fcfs" or "shortest_first" (engine/scheduler.py).
    prefill_order: str = "fcfs"
    # NOTE: time targets from the router's SLOs (engine/step_budget.py); None switches each off. A step that decodes
    # takes prompt tokens only within `step_target_ms` (the ITL budget); under shortest_first a prompt nearing
    # `ttft_target_ms` goes first.
    step_target_ms: float | None = None
    ttft_target_ms: float | None = None
    # Weight-only quantization of the linear layers: None (the dtype above) or "int8" (per output channel).
    quantization: str | None = None
    # KV cache storage: "auto" (the dtype above) or "int8" (a scale per block and KV head).
    kv_cache_dtype: str = "auto"
    # NOTE: None turns speculation off; a dict in vLLM's form is accepted and converted.
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters resident at once (vLLM's names); 0 turns LoRA off (the base path, untouched). With adapters, CUDA
    # steps run eagerly (no graphs: a step's adapter grouping changes from step to step).
    max_loras: int = 0
    max_lora_rank: int = 16  # the largest adapter rank accepted (engine/lora/adapter.py)
    # vLLM's name: ranks of one engine (one process each; engine/parallel/). > 1: num_blocks, kv_cache_memory_gb and
    # num_threads are per rank.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("num_blocks", self.num_blocks)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        _positive("num_threads", self.num_threads)
        _positive("max_lora_rank", self.max_lora_rank)
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise InvalidRequestError("max_loras", f"must be >= 0 (0: no adapters), got {self.max_loras!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size <= 0:
            raise InvalidRequestError("tensor_parallel_size", f"must be a positive integer, got "
                                      f"{self.tensor_parallel_size!r}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise InvalidRequestError("kv_cache_memory_gb", f"must be > 0, got {self.kv_cache_memory_gb}")
        if self.kv_cache_memory_gb is not None and self.gpu_memory_utilization is not None:
            raise InvalidRequestError("kv_cache_memory_gb", "and gpu_memory_utilization both size the KV pool: set one")
        for name in ("step_target_ms", "ttft_target_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InvalidRequestError(name, f"must be > 0 (or None: off), got {value}")
        check_dtype(self.dtype)
        check_device(self.device)
        if self.gpu_memory_utilization is not None:
            if not 0 < self.gpu_memory_utilization <= 1:
                raise InvalidRequestError("gpu_memory_utilization", f"must be in (0, 1], got "
                                          f"{self.gpu_memory_utilization}")
            if not self.device.startswith("cuda"):
                raise InvalidRequestError("gpu_memory_utilization", f"sizes a GPU's KV pool; device is "
                                          f"{self.device!r} (use kv_cache_memory_gb or num_blocks there)")
        if self.prefill_order not in ("fcfs", "shortest_first"):
            raise InvalidRequestError("prefill_order", f"use 'fcfs' or 'shortest_first', got {self.prefill_order!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise InvalidRequestError("quantization", f"use None or one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError("kv_cache_dtype", f"use one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        self.speculative_config = SpeculativeConfig.of(self.speculative_config)

    @property
    def threads(self) -> int:
        return self.num_threads or len(os.sched_getaffinity(0))

    @property
    def torch_dtype(self) -> torch.dtype:
        """The weights' and activations' dtype: `dtype`, with "auto" resolved for `device`."""
        return resolve_dtype(self.dtype, self.device)

    def resolved_device(self) -> torch.device:
        """The torch device to compute on; InvalidRequestError naming `device` when it is not usable here."""
        return resolve_device(self.device)


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16",
           "fp16": "float16"}  # name → torch's attribute


def check_dtype(name: object) -> None:
    """Refuse a dtype other than "auto", a name of `_DTYPES` or a torch dtype, naming the field (no torch needed)."""
    if isinstance(name, str) and (name == "auto" or name.lower() in _DTYPES):
        return
    if type(name).__module__ == "torch" and type(name).__name__ == "dtype":
        return
    raise InvalidRequestError("dtype", f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a dtype name ('float32', 'bf16', ...) to a torch dtype, or raise naming the field ("auto": float32, the
    CPU's choice; use `resolve_dtype` where the device is known)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    check_dtype(name)
    return torch.float32 if name == "auto" else getattr(torch, _DTYPES[name.lower()])


def resolve_dtype(name: str | torch.dtype, device: str | torch.device) -> torch.dtype:
    """`torch_dtype`, with "auto" = bfloat16 on CUDA and float32 elsewhere."""
    import torch

    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return torch_dtype(name)


_DEVICE_RE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(name: str) -> None:
    """Refuse a device string other than "cpu", "cuda" or "cuda:N", naming the field."""
    if not isinstance(name, str) or not _DEVICE_RE.fullmatch(name):
        raise InvalidRequestError("device", f"use 'cpu', 'cuda' or 'cuda:N', got {name!r}")


def resolve_device(name: str) -> torch.device:
    """The torch device `name` stands for on this machine, or InvalidRequestError naming `device`.

    NOTE: "cuda" is the current device; a Ray actor with num_gpus sees only the GPUs Ray gave it
    (CUDA_VISIBLE_DEVICES), so "cuda" there is its own GPU.
    """
    import torch

    check_device(name)
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InvalidRequestError("device", f"{name!r} needs a CUDA GPU, but torch {torch.__version__} sees none "
                                  f"(CUDA build: {torch.version.cuda or 'no'}); use device 'cpu'")
    device = torch.device(name)
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise InvalidRequestError("device", f"{name!r}: this process sees {count} GPU(s) (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


DEFAULT_KV_CACHE_GB = 1.0  # the KV pool's size on the CPU when neither num_blocks nor kv_cache_memory_gb is set
