"""CUDA graphs of decode-only steps, one per batch-size bucket, captured at warm-up (as nano-vllm and vLLM do).

1. `graph_buckets(max_num_seqs)`: the batch sizes captured, [1, 2, 4, 8, 16, 32, 64, ...] up to max_num_seqs (and
   max_num_seqs itself).
2. `DecodeGraphs.capture()`: per bucket of `rows` rows, static input ids, positions and attention metadata
   (engine/attention/__init__.py: shapes depend only on rows and the block-table width), one eager warm-up run,
   then the capture of the forward pass (embeddings → layers → final hidden states) into a shared memory pool.
3. `DecodeGraphs.run(...)`: a decode-only batch of n rows takes the smallest bucket >= n; its ids, positions and
   metadata are written into the bucket's host staging (numpy views laid out as the static buffers) and copied into
   them (one pinned non_blocking copy each for ids+positions and for the metadata), padded rows point at the
   runner's spare KV block (never a sequence's), and the graph replays.
   The caller computes logits and samples outside the graph, on the device, from the first n rows.
Only on CUDA, with the triton attention backend, and unless `enforce_eager` (engine/config.py); other steps
(prefill chunks, speculative verification, layer hooks for KV sending, batches above the largest bucket) run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.attention.metadata import slot_of

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]  # ids, positions, meta → hidden


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: powers of two below max_num_seqs, then max_num_seqs."""
    buckets = []
    b = 1
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    return [*buckets, max_num_seqs]


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds n rows, or None when n exceeds them all (that step runs eagerly)."""
    return next((b for b in buckets if b >= n), None)


def graphs_wanted(device: torch.device, backend: str, enforce_eager: bool) -> bool:
    """Whether an engine captures decode graphs: on CUDA with the triton backend, unless enforce_eager."""
    return device.type == "cuda" and backend == "triton" and not enforce_eager


class _HostTwin:
    """A pinned host buffer laid out as a bucket's static tensors, with numpy views of each (see GraphBucket)."""

    def __init__(self, rows: int, ids: torch.Tensor, meta: AttentionMetadata, cuda: bool) -> None:
        assert meta.packed is not None and meta.triton is not None
        meta_bytes = meta.packed.buffer.numel()
        self.buffer = torch.empty(meta_bytes + ids.numel() * 8, dtype=torch.uint8, pin_memory=cuda)
        self.buffer[:meta_bytes].copy_(meta.packed.host)
        self.meta_host, self.ids_host = self.buffer[:meta_bytes], self.buffer[meta_bytes:]
        raw = self.buffer.numpy()
        base = meta.packed.buffer.data_ptr()

        def view(t: torch.Tensor) -> np.ndarray:  # the host twin of a static tensor (a view of the device buffer)
            start = t.data_ptr() - base
            return raw[start : start + t.numel() * t.element_size()].view(_NP[t.dtype]).reshape(t.shape)

        self.slots, self.tables, self.seq_lens = view(meta.slot_mapping), view(meta.triton.block_tables), view(
            meta.triton.seq_lens)
        self.ids = raw[meta_bytes:].view(np.int64).reshape(2, rows)
        self.copied = torch.cuda.Event() if cuda else None  # recorded after the copies out of this buffer


class GraphBucket:
    """One captured bucket: its graph, the static tensors it reads and writes, and their host staging.

    NOTE: a step's values are written straight into numpy views of a host buffer laid out as the static tensors
    (pinned on CUDA) and copied with two non-blocking copies: the metadata builder takes 133 us of host time a step
    at batch 1 and 247 us at batch 64, the staging 7 and 64 us (`python -m pdcluster.bench.engine_profile`, this
    project's CPU), time the GPU waits for the graph (a batch-1 step of an 8B model on an H200 is ~5 ms). Two such
    buffers take turns: a step staged while the one before is still queued on the GPU (the runner's lookahead) must
    not overwrite what that step's copy has yet to read; each waits for the copy out of it two steps back (an event).
    Block-table columns past a row's blocks keep whatever an earlier step left: the kernels never read them.
    """

    def __init__(self, rows: int, ids: torch.Tensor, meta: AttentionMetadata, cuda: bool) -> None:
        self.rows = rows
        self.ids_pos = ids  # [2, rows] int64: input ids, then positions
        self.meta = meta
        self.graph = torch.cuda.CUDAGraph() if cuda else None
        self.hidden: torch.Tensor | None = None  # [rows, d], written by every replay
        self._twins = [_HostTwin(rows, ids, meta, cuda) for _ in range(2)]
        self._staged = self._twins[0]

    def stage(self, ids: Sequence[int], positions: list[int], tables: list[list[int]], starts: list[int],
              block_size: int, spare: int) -> None:
        """Write a decode-only batch of n <= rows rows into the next host buffer (padded rows: token 0 at position
        0, writing and attending block `spare`'s first slot)."""
        n = len(ids)
        if n > self.rows:
            raise ValueError(f"{n} rows do not fit a bucket of {self.rows}")
        t = self._twins[1] if self._staged is self._twins[0] else self._twins[0]
        width = t.tables.shape[1]
        if t.copied is not None:
            t.copied.synchronize()  # NOTE: the copy out of this buffer two steps back (done long ago but at startup)
        for i, (table, start) in enumerate(zip(tables, starts)):
            if len(table) > width:
                raise ValueError(f"a block table of {len(table)} blocks is wider than the graph's {width}")
            t.tables[i, : len(table)] = table
            t.slots[i] = slot_of(table, start, block_size)
        t.seq_lens[:n] = starts
        t.seq_lens[:n] += 1
        t.tables[n:, 0] = spare
        t.slots[n:] = spare * block_size
        t.seq_lens[n:] = 1
        t.ids[0, :n], t.ids[1, :n] = ids, positions
        t.ids[:, n:] = 0
        self._staged = t

    def upload(self) -> None:
        """The staged step into the static tensors (two non-blocking copies, queued before the replay)."""
        assert self.meta.packed is not None
        t, cuda = self._staged, self.graph is not None
        self.meta.packed.buffer.copy_(t.meta_host, non_blocking=cuda)
        self.ids_pos.view(-1).view(torch.uint8).copy_(t.ids_host, non_blocking=cuda)
        if t.copied is not None:
            t.copied.record()


_NP = {torch.int64: np.int64, torch.int32: np.int32}


class DecodeGraphs:
    """Decode-step graphs of one model runner, one per bucket (see the module docstring)."""

    def __init__(self, forward: Forward, device: torch.device, block_size: int, spare_block: int, max_blocks: int,
                 buckets: Sequence[int]) -> None:
        self.forward = forward
        self.device = device
        self.block_size = block_size
        self.spare_block = spare_block  # NOTE: outside the block manager: padded rows write and read only this block
        self.max_blocks = max_blocks  # block-table width every graph takes (cdiv(max_model_len, block_size))
        self.buckets = list(buckets)
        self.graphs: dict[int, GraphBucket] = {}

    def _static_meta(self, rows: int) -> AttentionMetadata:
        s = self.spare_block
        return AttentionMetadata.build([[s]] * rows, [0] * rows, [1] * rows, self.block_size, device=self.device,
                                       backend="triton", pad_blocks=self.max_blocks, pad_block=s)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller ones then reuse the pool's memory).

        NOTE: on a device without CUDA graphs (the CPU, with Triton's interpreter: the tests) only the static buffers
        are made, and `run` computes the forward over them eagerly: the same padding and copies, no graph.
        """
        pool = None
        cuda = self.device.type == "cuda"
        for rows in sorted(self.buckets, reverse=True):
            ids_pos = torch.zeros(2, rows, dtype=torch.long, device=self.device)
            g = GraphBucket(rows, ids_pos, self._static_meta(rows), cuda)
            if cuda:
                # NOTE: the warm-up launch on a side stream: Triton compiles on a kernel's first launch, which must
                # not happen during capture (engine/attention/__init__.py)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self.forward(ids_pos[0], ids_pos[1], g.meta)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                assert g.graph is not None
                with torch.cuda.graph(g.graph, pool=pool):
                    g.hidden = self.forward(ids_pos[0], ids_pos[1], g.meta)
                pool = g.graph.pool()
            self.graphs[rows] = g
        if cuda:
            torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def run(self, ids: Sequence[int], positions: list[int], tables: list[list[int]], starts: list[int],
            ids_on_device: torch.Tensor | None = None) -> torch.Tensor | None:
        """Hidden states [n, d] of a decode-only batch by graph replay, or None when no bucket holds it.

        `ids_on_device` ([n] int64 on the device): the input ids, copied on the device after the upload (the
        previous step's sampled ids, before they reached the host: the runner's lookahead); `ids` then only counts
        the rows.
        """
        rows = bucket_for(len(ids), self.buckets)
        if rows is None or rows not in self.graphs:
            return None
        g = self.graphs[rows]
        g.stage(ids, positions, tables, starts, self.block_size, self.spare_block)
        g.upload()
        if ids_on_device is not None:
            g.ids_pos[0, : len(ids)].copy_(ids_on_device)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.hidden = self.forward(g.ids_pos[0], g.ids_pos[1], g.meta)
        assert g.hidden is not None
        return g.hidden[: len(ids)]
