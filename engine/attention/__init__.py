"""Attention over the paged KV cache: the one seam (`paged_attention`, `write_kv`, `AttentionMetadata`) and its
backends, chosen once per engine by `select_backend(device, kv_dtype)` from `PDCLUSTER_ATTENTION`:

- `auto` (default): `triton` on CUDA (`gather` for an int8 KV cache), on the CPU `kernel` when built, else `gather`;
- `kernel`: the compiled CPU kernel (engine/csrc/), planned by `inplace.py` / `cascade.py`: reads KV blocks in
  place, attends prefixes shared by several decode entries once per group; CPU only, float and int8 caches;
- `gather`: the pure-torch path in `paged.py` (gather blocks + SDPA) on any device, the reference every backend is
  tested against (`paged.py` also holds the seam's two functions);
- `triton`: the Triton kernels (`triton_kernels.py`, glue in `triton_backend.py`): split-KV paged decode with GQA,
  varlen prefill over a cached context, the KV write; any device (on the CPU only under TRITON_INTERPRET=1, set
  before the kernels are imported: tests).

The step's metadata (`metadata.py`):
`AttentionMetadata.build(block_tables, starts, num_new, block_size, device=..., backend=...)` lays the flat batch
out (decode rows first, then prefill chunks), builds every tensor on the host (pinned for CUDA) and moves them with
one non-blocking copy (`pack.py`); layers only read it (`write_kv(..., meta)`, `paged_attention(..., meta, scale)`),
nothing in them creates a host tensor or syncs.

CUDA graphs (decode-only steps, triton backend). For a decode-only batch of B rows the metadata's tensors have
shapes that depend only on (B, max_blocks), the block-table width:
    meta.slot_mapping              [B] int64   cache slot (block_id * block_size + offset) of each row's new K/V
    meta.triton.block_tables       [B, max_blocks] int32
    meta.triton.seq_lens           [B] int32   tokens each row attends (its new token included)
    meta.triton.q_start / q_lens / ctx_lens [0] int32, ctx_block_tables [0, 0] int32 (no prefill)
and its host values (num_decode = B, triton.num_splits = num_kv_splits(B, max_blocks, block_size), max_q_len = 0,
own = []) are functions of those shapes too. The kernels read only these tensors, shapes and constexprs at launch:
no `.item()`, no Python value derived from tensor data, grids from shapes; their scratch buffers are allocated per
call (from the graph's pool under capture).
How a runner uses it:
1. reserve one spare KV block `S` that no sequence ever gets (the runner's, out of the block manager);
2. at capture, per bucket of `rows` rows: `static = AttentionMetadata.build([[S]] * rows, [0] * rows, [1] * rows,
   block_size, device=dev, backend="triton", pad_blocks=max_blocks, pad_block=S)` (max_blocks = the widest table
   the graph must take, e.g. cdiv(max_model_len, block_size)), run the forward with `static` once outside the
   capture (Triton compiles a kernel on its first launch, which a capture must not see), then capture it;
3. per step, a decode-only batch of B <= rows: `AttentionMetadata.build(tables, starts, [1] * B, block_size,
   device=dev, backend="triton", pad_rows=rows, pad_blocks=max_blocks, pad_block=S, out=static)` packs on the host
   and copies once (non-blocking, pinned) into `static`'s buffer (`static.copy_from(meta)` does the same for a
   metadata built separately; differing shapes raise ValueError); pad input ids / positions to `rows` (any token,
   position 0) and replay. (engine/cuda_graphs.py writes the same values into a host twin of the static buffers
   instead, without the builder's tensor ops: `GraphBucket.stage`.)
Padded rows are harmless: each writes its K/V into slot S * block_size (block S's first slot) and attends that one
slot (seq_len 1, block table row S first), so they never touch a real sequence's blocks; their output rows are
ignored. Table columns past a row's length are never read (loads are masked by seq_len): the builder fills them
with S, the graphs' staging leaves them as they were.
tests/test_triton_attention.py::test_a_cuda_graph_replays_decode_over_the_static_metadata follows this recipe (gpu).
"""

from engine.attention.backend import select_backend, triton_interpreting
from engine.attention.metadata import (
    DECODE_PAD_RATIO,
    PREFILL_CHUNK,
    PREFILL_MODES,
    AttentionMetadata,
    DecodeGroup,
    PrefillSpan,
)
from engine.attention.paged import paged_attention, write_kv
from engine.attention.triton_backend import TritonMetadata, num_kv_splits

__all__ = ["DECODE_PAD_RATIO", "PREFILL_CHUNK", "PREFILL_MODES", "AttentionMetadata", "DecodeGroup", "PrefillSpan",
           "TritonMetadata", "num_kv_splits", "paged_attention", "select_backend", "triton_interpreting", "write_kv"]
