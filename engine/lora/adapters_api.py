"""The LoRA methods of LLMEngine: the resident adapters (`lora`), loading and unloading them, their block-hash keys.

NOTE: a base class of LLMEngine, split off by concept as engine/kv_seam.py is; it reads the engine's config, runner
and request table, declared below. In a TP group the slots hold rank 0's share of each adapter and the runner sends
every follower its own (engine/parallel/lora.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import EngineConfig, ModelConfig
from engine.lora.slots import LoRASlots, adapter_key, slots_of
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


class LoRAAdapters:
    """The engine's adapter methods (load_lora, unload_lora, lora_names, lora_key)."""

    config: EngineConfig
    runner: ModelRunner
    _seqs: dict[str, Sequence]
    lora: LoRASlots | None  # the resident adapters (engine/lora/); None with max_loras = 0

    def _make_lora(self, mcfg: ModelConfig) -> None:
        """The adapter slots (max_loras > 0), around the runner's linears: in a TP group, rank 0's share of each."""
        self.lora = None
        if self.config.max_loras:
            n = self.config.tensor_parallel_size
            share = None
            if n > 1:
                from engine.parallel.lora import rank_share

                share = rank_share(mcfg, 0, n)
            self.lora = LoRASlots.around(self.runner, mcfg, self.config, share)

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name` (requests choose it with SamplingParams.lora); a bad adapter
        is refused with LoRALoadError naming what is wrong, and the engine serves on as before."""
        slot, adapter = slots_of(self.lora).load(name, path)
        send = getattr(self.runner, "load_lora", None)  # NOTE: a TP group's runner: each follower gets its share
        if send is not None:
            send(name, slot, adapter)

    def unload_lora(self, name: str) -> None:
        """Free adapter `name`'s slot; refused while a request uses it (its cached blocks age out as others do)."""
        slots_of(self.lora).unload(name, [s.request_id for s in self._seqs.values() if s.params.lora == name])
        send = getattr(self.runner, "unload_lora", None)
        if send is not None:
            send(name)

    def lora_names(self) -> list[str]:
        """The names of the loaded adapters."""
        return [] if self.lora is None else self.lora.names()

    def lora_key(self, name: str | None, request_id: str) -> str:
        """The block-hash extra key of a request's adapter ("" for the base model); unknown names refused."""
        return adapter_key(self.lora, name, request_id)
