"""GGUF files (llama.cpp): metadata → ModelConfig, dequantized weights under HF names, and a disk cache.

1. A cache hit (same absolute path, size and mtime) reads config, tokenizer and weights from one safetensors file
   (float32), tensor by tensor, each converted to the target dtype and device as it is read.
2. A miss parses the GGUF, dequantizes every tensor (one at a time, to float32, then to the target), undoes
   llama.cpp's q/k row permutation (llama arch only), renames to Hugging Face names, and, when the target is float32
   on the CPU (the cache's own form), writes the cache atomically for the next process.
NOTE: only one tensor at a time is ever float32 on the host, so an 8B model loads to a GPU in bfloat16 without a
float32 copy of the model in host memory.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import sys
from typing import Any

import gguf
import numpy as np
import torch
from gguf.quants import dequantize
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from engine.config import ModelConfig, RopeScaling
from engine.errors import ModelLoadError
from engine.hf_loader import Weights, check_weights
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# NOTE: bump when the conversion changes, so that caches written by older code are not trusted.
_CACHE_FORMAT = "pdcluster-gguf-cache-v1"
# Architecture → whether llama.cpp's converter permuted the q/k rows (LlamaModel does; Qwen2Model does not).
_ARCHITECTURES = {"llama": True, "qwen2": False}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def cache_dir() -> str:
    """Where dequantized weights are cached: $PDCLUSTER_CACHE_DIR, default ~/.cache/pdcluster."""
    return os.environ.get("PDCLUSTER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pdcluster")


def _source_key(path: str) -> str:
    st = os.stat(path)
    return f"{_CACHE_FORMAT}|{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"


def cache_path(path: str) -> str:
    """The cache file for this GGUF file as it is now (a changed size or mtime gives a new file)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return os.path.join(cache_dir(), "gguf", f"{stem}-{hashlib.sha256(_source_key(path).encode()).hexdigest()[:24]}"
                                              ".safetensors")


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _require(reader: gguf.GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ModelLoadError("model", f"GGUF metadata has no {key!r}")
    return value


def _f32(value: Any) -> float:
    # NOTE: GGUF stores floats as float32; its shortest repr turns 9.999999747e-06 back into the intended 1e-05.
    return float(str(np.float32(value)))


def gguf_model_id(path: str, reader: gguf.GGUFReader) -> str:
    """f"{name}-{12 hex of sha256 over the file}"; the name comes from the metadata, so the path does not matter."""
    name = "-".join(str(v) for v in (_field(reader, "general.basename"), _field(reader, "general.size_label")) if v)
    slug = re.sub(r"[^a-z0-9.]+", "-", (name or str(_field(reader, "general.architecture"))).lower()).strip("-")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return f"{slug}-{digest.hexdigest()[:12]}"


def gguf_config(reader: gguf.GGUFReader, *, name: str, model_id: str) -> ModelConfig:
    """ModelConfig from the GGUF metadata ({arch}.* keys) and tensor list."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError("model", f"unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError("model", "GGUF with rope_freqs (llama3-style RoPE scaling) is not supported; "
                                      "load the Hugging Face checkpoint directory instead")
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    scaling = None
    if scaling_type == "linear":
        scaling = RopeScaling("linear", factor=_f32(_field(reader, f"{arch}.rope.scaling.factor")))
    elif scaling_type not in (None, "none"):
        raise ModelLoadError("model", f"unsupported GGUF rope scaling type {scaling_type!r}")
    heads = _require(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or heads
    hidden = int(_require(reader, f"{arch}.embedding_length"))
    # NOTE: some files give per-layer head counts as arrays; this engine needs one count for every layer.
    if not isinstance(heads, int) or not isinstance(kv_heads, int) or heads % kv_heads:
        raise ModelLoadError("model", f"unsupported attention.head_count {heads} / head_count_kv {kv_heads}")
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return ModelConfig(
        name=name, model_id=model_id, vocab_size=int(tensors["token_embd.weight"].shape[1]), hidden_size=hidden,
        intermediate_size=int(_require(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_require(reader, f"{arch}.block_count")), num_heads=int(heads), num_kv_heads=int(kv_heads),
        head_dim=int(_field(reader, f"{arch}.attention.key_length") or hidden // heads),
        rope_theta=_f32(_field(reader, f"{arch}.rope.freq_base") or 10000.0), rope_scaling=scaling,
        rms_norm_eps=_f32(_require(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_require(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors, attention_out_bias="blk.0.attn_output.bias" in tensors,
        bos_token_id=None if (bos := _field(reader, "tokenizer.ggml.bos_token_id")) is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)))


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ModelLoadError("model", f"GGUF tensor {name!r} has no Hugging Face Llama equivalent")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # NOTE: llama.cpp's converter interleaves the two rotary halves of each head's rows (q/k weight and bias);
    # this restores HF's [first half | second half] order.
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_weights(reader: gguf.GGUFReader, config: ModelConfig, *, progress: bool = False,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Weights:
    """Every tensor dequantized under HF names, q/k rows in HF order, contiguous, in `dtype` on `device`."""
    permuted = _ARCHITECTURES[str(_field(reader, "general.architecture"))]
    weights: Weights = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=not progress, file=sys.stderr):
        name = _hf_name(t.name)
        shape = [int(d) for d in reversed(t.shape.tolist())]  # GGUF lists dims innermost first
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)).reshape(shape)
        if permuted and ".q_proj." in name:
            w = _unpermute(w, config.num_heads)
        elif permuted and ".k_proj." in name:
            w = _unpermute(w, config.num_kv_heads)
        weights[name] = w.to(device=device, dtype=dtype).contiguous()
    return weights


def _config_to_json(config: ModelConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def _config_from_json(text: str) -> ModelConfig:
    d = json.loads(text)
    scaling = d.pop("rope_scaling")
    return ModelConfig(**d | {"rope_scaling": RopeScaling(**scaling) if scaling else None,
                              "eos_token_ids": tuple(d["eos_token_ids"])})


def _read_cache(file: str, source: str, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Weights, Tokenizer] | None:
    """The cached model (each tensor in `dtype` on `device`), or None if the file is missing, partial, corrupt or
    for another source."""
    if not os.path.isfile(file):
        return None
    try:
        with safe_open(file, framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("source") != source:
                return None
            config = _config_from_json(meta["config"])
            # NOTE: tensor by tensor (not load_file): a bf16 GPU load never holds the float32 model in host memory
            weights = {k: f.get_tensor(k).to(device=device, dtype=dtype).contiguous() for k in f.keys()}
        check_weights(config, weights, file)
        return config, weights, Tokenizer.from_json(meta["tokenizer"])
    except Exception as e:  # any failure means "rebuild": safetensors, JSON and shape errors alike
        logger.warning("ignoring unreadable weight cache %s (%s); rebuilding it", file, e)
        return None


def _write_cache(file: str, source: str, config: ModelConfig, weights: Weights, tokenizer: Tokenizer) -> None:
    # NOTE: several processes may load the same model at once; each writes its own temporary file and
    # os.replace makes the finished one appear atomically, so no reader ever sees a partial cache.
    tmp = f"{file}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        os.makedirs(os.path.dirname(file), exist_ok=True)
        save_file(weights, tmp, metadata={"source": source, "config": _config_to_json(config),
                                          "tokenizer": tokenizer.to_json()})
        os.replace(tmp, file)
    except Exception as e:  # best effort: a read-only or full disk costs speed next time, not this load
        logger.warning("cannot write weight cache %s: %s", file, e)
        if os.path.exists(tmp):
            os.remove(tmp)


def load_gguf(path: str, name: str, *, progress: bool = False, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, Weights, Tokenizer]:
    """Config, weights (in `dtype` on `device`) and tokenizer of a GGUF file, from the cache when it is fresh."""
    source, file = _source_key(path), cache_path(path)
    if (cached := _read_cache(file, source, device, dtype)) is not None:
        config, weights, tokenizer = cached
        return dataclasses.replace(config, name=name), weights, tokenizer
    reader = _open(path)
    config = gguf_config(reader, name=name, model_id=gguf_model_id(path, reader))
    tokenizer = Tokenizer.from_gguf(reader)
    weights = gguf_weights(reader, config, progress=progress, device=device, dtype=dtype)
    check_weights(config, weights, path)
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        # NOTE: the cache holds float32 CPU tensors; writing it from another target would need the float32 model
        # on the host, which a GPU load must never build (the next float32 CPU load writes it).
        _write_cache(file, source, config, weights, tokenizer)
    return config, weights, tokenizer


def _open(path: str) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # gguf raises ValueError/struct errors on a file that is not GGUF
        raise ModelLoadError("model", f"cannot read GGUF file {path}: {e}") from e


def gguf_tokenizer(path: str) -> Tokenizer:
    """Only the tokenizer of a GGUF file: from the weight cache's header if there is one, else from the file."""
    return _gguf_tokenizer(_source_key(path), cache_path(path), path)


@functools.lru_cache(maxsize=4)
def _gguf_tokenizer(source: str, file: str, path: str) -> Tokenizer:
    try:
        with safe_open(file, framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("source") == source:
            return Tokenizer.from_json(meta["tokenizer"])
    except Exception:  # no cache or a bad one: parse the GGUF (about 2 s)
        pass
    return Tokenizer.from_gguf(_open(path))
