"""LoRA adapters in the deploy config (vLLM's `--lora-modules`, `--max-loras`, `--max-lora-rank`).

Every worker (prefill and decode alike: both phases of a request run with its adapter) loads `modules` at start;
a request chooses one by naming it as its OpenAI `model` (gRPC: `model`). More can be loaded while serving through
`/v1/load_lora_adapter` (admin key), up to `max_loras` resident per worker.
"""

from __future__ import annotations

import os
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdcluster.config_rules import RuleError
from router.lora import ADAPTER_NAME

PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")  # NOTE: engine/lora/adapter.py reads these


class LoRAConfig(BaseModel):
    """Multi-LoRA serving: PEFT adapters every worker loads, chosen per request by `model`."""

    model_config = ConfigDict(extra="forbid")

    modules: dict[Annotated[str, Field(pattern=ADAPTER_NAME)], Annotated[str, Field(min_length=1)]] = Field(
        default_factory=dict, description="adapters loaded at start, name → PEFT directory (adapter_config.json + "
        "adapter_model.safetensors; same path on every node), e.g. {sql: /adapters/sql}")
    max_loras: int | None = Field(default=None, ge=0, description="adapters resident per worker at most (slots "
                                  "sized at start); null: as many as `modules` lists; 0: no adapters")
    max_lora_rank: int = Field(default=16, gt=0, description="the largest adapter rank accepted (slots are sized "
                               "for it)")

    @model_validator(mode="after")
    def _check(self) -> LoRAConfig:
        if self.max_loras is not None and len(self.modules) > self.max_loras:
            raise RuleError("max_loras", f"is {self.max_loras} but modules lists {len(self.modules)} adapters: "
                                         "every one of them is resident on every worker")
        return self

    @property
    def slots(self) -> int:
        """Adapters resident per worker: `max_loras`, or as many as `modules` lists."""
        return len(self.modules) if self.max_loras is None else self.max_loras

    def missing_files(self) -> list[str]:
        """Each module whose directory lacks a PEFT file here, as "lora.modules.<name>: ..." (checked where the
        workers run on this machine, before they start: a worker that cannot load one fails its start)."""
        problems = []
        for name, path in self.modules.items():
            missing = [f for f in PEFT_FILES if not os.path.isfile(os.path.join(path, f))]
            if missing:
                problems.append(f"lora.modules.{name}: {path} lacks {' and '.join(missing)} (a PEFT adapter "
                                f"directory holds {' and '.join(PEFT_FILES)})")
        return problems

