"""Multi-LoRA serving: PEFT adapters loaded into slots, each batch row's delta added beside the base linears.

`adapter.py` reads and checks an adapter; `slots.py` keeps the resident ones (max_loras) and wraps the model's
linears; `batch.py` groups a step's rows per adapter and computes the deltas (torch on the CPU, `sgmv.py`'s Triton
kernels with the Triton backend, i.e. on CUDA).
"""

from engine.lora.adapter import LoRAAdapter, LoRALoadError, load_adapter

__all__ = ["LoRAAdapter", "LoRALoadError", "load_adapter"]
