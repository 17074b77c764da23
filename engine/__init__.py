"""pdcluster's model runtime: a Llama-family engine over a paged, prefix-cached KV cache.

Shared by the prefill and decode pools; `LLM` is the colocated, in-process API.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig
    from engine.errors import CapacityError, EngineError, InvalidRequestError, ModelLoadError
    from engine.kv_export import KVLayout
    from engine.kv_import import KVImporter, KVReservation
    from engine.llm import LLM, Completion
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

# NOTE: imported on first use: the router's process takes the engine's request types (SamplingParams, errors, the
# tokenizer) and never runs a model, so importing a light submodule must not pull in torch (1.5 s, ~300 MB)
_HOME = {"EngineConfig": "config", "ModelConfig": "config", "CapacityError": "errors", "EngineError": "errors",
         "InvalidRequestError": "errors", "ModelLoadError": "errors", "KVLayout": "kv_export",
         "KVImporter": "kv_import", "KVReservation": "kv_import", "LLM": "llm", "Completion": "llm",
         "LLMEngine": "llm_engine", "SamplingParams": "sampling_params"}

__all__ = ["LLM", "CapacityError", "Completion", "EngineConfig", "EngineError", "InvalidRequestError", "KVImporter",
           "KVLayout", "KVReservation", "LLMEngine", "ModelConfig", "ModelLoadError", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(f"engine.{_HOME[name]}"), name)
