"""pdcluster's model runtime: a Llama-family engine over a paged, prefix-cached KV cache.

Shared by the prefill and decode pools; `LLM` is the colocated, in-process API.
"""

from engine.config import EngineConfig, ModelConfig
from engine.errors import CapacityError, EngineError, InvalidRequestError, ModelLoadError
from engine.kv_export import KVLayout
from engine.kv_import import KVImporter, KVReservation
from engine.llm import LLM, Completion
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CapacityError", "Completion", "EngineConfig", "EngineError", "InvalidRequestError", "KVImporter",
           "KVLayout", "KVReservation", "LLMEngine", "ModelConfig", "ModelLoadError", "SamplingParams"]
