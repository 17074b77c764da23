"""Attention over the paged KV cache: the one seam (`paged_attention`, `write_kv`, `AttentionMetadata`) and its
backends.

- `paged.py`: the seam, the per-step metadata, and the pure-torch path (gather + SDPA), the reference the other
  backends are tested against;
- `inplace.py`, `cascade.py`: the plan of the compiled CPU kernel (engine/csrc/paged_attention.cpp), which reads KV
  blocks in place and attends prefixes shared by several decode entries once per group.
"""

from engine.attention.paged import (
    DECODE_PAD_RATIO,
    PREFILL_CHUNK,
    PREFILL_MODES,
    AttentionMetadata,
    DecodeGroup,
    PrefillSpan,
    paged_attention,
    write_kv,
)

__all__ = ["DECODE_PAD_RATIO", "PREFILL_CHUNK", "PREFILL_MODES", "AttentionMetadata", "DecodeGroup", "PrefillSpan",
           "paged_attention", "write_kv"]
