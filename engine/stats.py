"""The counters an engine reports (`LLMEngine.stats`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineStats:
    """Counters a worker reports: pool occupancy and prefix-cache effectiveness."""

    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_waiting: int
    num_running: int
    num_reserved: int  # requests whose incoming KV has blocks reserved, not yet committed
    prompt_tokens: int
    cached_prompt_tokens: int
    computed_tokens: int  # tokens run through the model (prefill chunks + decode steps)
    num_preemptions: int
    spec_draft_tokens: int = 0  # draft tokens verified (speculative decoding)
    spec_accepted_tokens: int = 0  # of those, accepted by the target model
    num_paused: int = 0  # of the running ones, paused by their consumer (a client that stopped reading)
