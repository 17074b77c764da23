"""StepBudget: how many prompt tokens a step may take beside its decode batch, and when a waiting prompt is overdue.

Both follow from time targets and the engine's measured step cost (step ≈ base + tokens × per token), which the
worker fits after every step (cluster/worker.py) and hands in with `set_cost`:
1. the ITL budget (`prompt_tokens`): a step that decodes for someone stays within `step_target_s`, so its prompt
   tokens are what is left of the target after the decode tokens: many when the batch is small, none when decode
   alone fills the step. A step without decode tokens has no one's inter-token gap to protect: no cap;
2. the TTFT bound (`overdue`): under `shortest_first`, a prompt that has waited so long that its own remaining
   compute would take it past `ttft_target_s` goes first, so a document still gets its first token in time behind a
   stream of short prompts.
The router predicts with the same formula from the same heartbeat numbers (router/policy.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config import EngineConfig

# NOTE: prompt work that got no token for this many steps in a row because decode filled every step gets one block a
# step from then on (a prompt the router placed before the batch grew, or a failover's continuation, must not wait
# for the whole batch to finish)
STARVED_STEPS_MAX = 32
# NOTE: a waiting prompt is promoted once its age plus its own compute reaches this fraction of the TTFT target: the
# rest is the margin for the steps it shares with the decode batch and the prompts already running
OVERDUE_FRACTION = 0.75


@dataclass
class StepBudget:
    """Per-step limits from time targets and the measured step cost; None targets switch a limit off."""

    step_target_s: float | None = None  # a step with decode tokens in it stays within this (router.slo_itl_ms)
    ttft_target_s: float | None = None  # a prompt's first token target (router.slo_ttft_ms): the promotion bound
    base_s: float = 0.02  # fixed cost of a step (prior until the worker measured; cluster/worker_metrics.py)
    per_token_s: float = 0.0005  # cost per token computed in a step
    starved: int = 0  # steps in a row whose prompt work got no token because decode filled them

    @classmethod
    def of(cls, config: EngineConfig) -> StepBudget:
        """The limits an engine's settings ask for."""
        return cls(None if config.step_target_ms is None else config.step_target_ms / 1e3,
                   None if config.ttft_target_ms is None else config.ttft_target_ms / 1e3)

    def set_cost(self, base_s: float, per_token_s: float) -> None:
        """The step cost as the worker measured it."""
        self.base_s, self.per_token_s = max(0.0, base_s), max(1e-9, per_token_s)

    def prompt_tokens(self, decode_tokens: int) -> int | None:
        """Prompt tokens a step with `decode_tokens` decode tokens may add within the step target (None: no cap)."""
        if self.step_target_s is None or decode_tokens <= 0:
            return None
        room = (self.step_target_s - self.base_s) / self.per_token_s - decode_tokens
        return max(0, math.floor(room))

    def step_cap(self, decode_tokens: int, has_prompt_work: bool, block_size: int) -> int | None:
        """Prompt tokens this step may take (None: no cap): the ITL budget, or one block once prompt work has had
        none for STARVED_STEPS_MAX steps in a row (counted here: call it once per step)."""
        cap = self.prompt_tokens(decode_tokens)
        if cap is None or not has_prompt_work or cap > 0:
            self.starved = 0
            return cap
        self.starved += 1
        return block_size if self.starved >= STARVED_STEPS_MAX else 0

    def overdue(self, waited_s: float, tokens_left: int, step_limit: int) -> bool:
        """Whether a prompt that waited `waited_s` with `tokens_left` to compute must go first to meet the target."""
        if self.ttft_target_s is None:
            return False
        own_s = math.ceil(tokens_left / max(1, step_limit)) * self.base_s + tokens_left * self.per_token_s
        return waited_s + own_s >= OVERDUE_FRACTION * self.ttft_target_s
