"""Owns the model and the KV memory; turns a scheduled batch into tensors, runs it and samples.

The runner makes no scheduling decisions: it computes what the scheduler picked.
One step on any device: every per-step tensor (token ids, positions, the rows that need logits, the attention
metadata) is built on the host once, pinned on CUDA, and copied with one non_blocking transfer; layers only read
them. The sampled ids are the step's one sync with the host (`_to_host`). With CUDA graphs, a decode step launches
the next step of the same batch before that sync (`Lookahead`), so the GPU need not wait for the host's scheduling.

Seeded sampling across devices: a request's random stream is a pure function of (seed, output index)
(engine/sampler.py), so a request resumed on another worker of the same device type draws the same tokens. A CPU and
a GPU worker derive the same per-token seeds, but their generators (the CPU's Mersenne Twister, CUDA's Philox) turn
them into different draws: one seeded request gives different, equally distributed, samples on a CPU worker and on a
GPU worker (greedy requests agree up to near-ties: pdcluster/bench/engine_gpu.py).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch

from engine import host_memory
from engine.attention import AttentionMetadata, select_backend
from engine.attention.pack import pack
from engine.config import EngineConfig, ModelConfig
from engine.cuda_graphs import DecodeGraphs, bucket_for, graph_buckets, graphs_wanted
from engine.errors import InvalidRequestError
from engine.gpu_memory import profile_num_blocks
from engine.kernels import attention_kernel
from engine.logprobs import prompt_logprobs, sampled_logprobs
from engine.model import LlamaModel
from engine.pool_size import kv_block_rows, kv_cache_dtype
from engine.sampler import SamplerOutput, sample
from engine.scheduler import ScheduledBatch
from engine.spec_decode import verify
from engine.step import Lookahead, NextRow, Step, layout
from engine.structured_output import grammar_bitmask


class ModelRunner:
    """Runs forward passes over the paged KV cache (`kv[layer][0|1]`: [num_blocks + 1, block_size, KVH, D]).

    With an int8 KV cache a block has one more row, for its per-head scales (engine/kv_quant.py). The last block is
    the runner's spare (`spare_block`), outside the block manager: padded rows of a CUDA graph write and read it.
    `num_blocks=None` (CUDA) sizes the pool by gpu_memory_utilization after a profiling forward pass.
    """

    def __init__(self, cfg: ModelConfig, engine_cfg: EngineConfig, weights: dict[str, torch.Tensor],
                 num_blocks: int | None, max_model_len: int, *, max_blocks: int | None = None,
                 device: torch.device | None = None) -> None:
        self.cfg = cfg
        # NOTE: `device` overrides the config's for tests that run the step on the meta device
        self.device = device if device is not None else engine_cfg.resolved_device()
        self.dtype = engine_cfg.torch_dtype
        self.kv_dtype = kv_cache_dtype(engine_cfg)
        self.block_size = engine_cfg.block_size
        # NOTE: read once here so every step of this engine takes the same path; the Triton backend also takes the
        # layers' pointwise work (engine/triton_ops.py)
        self.attn_backend = select_backend(self.device, self.kv_dtype)  # engine/attention/backend.py
        self.model = LlamaModel(cfg, weights, self.dtype, max_model_len, engine_cfg.quantization, self.device,
                                triton=self.attn_backend == "triton")
        if self.kv_dtype == torch.int8 and cfg.head_dim < 4:
            raise InvalidRequestError("kv_cache_dtype", f"int8 KV needs head_dim >= 4 (its scale row), got "
                                      f"{cfg.head_dim}")
        self.attn_kernel = attention_kernel() if self.attn_backend == "kernel" else None
        self.attn_cascade = True  # shared decode prefixes attended once per group (kernel path)
        self.attn_prefill: Literal["flash", "chunked"] = "flash"  # engine/attention/paged.py PREFILL_MODES
        if num_blocks is None:
            with self.on_device():
                num_blocks = profile_num_blocks(self, engine_cfg, max_blocks)
        self.num_blocks = num_blocks
        self.spare_block = num_blocks
        self._allocate_kv(num_blocks + 1)
        self.graphs: DecodeGraphs | None = None
        self.max_model_len = max_model_len
        self._ahead: Lookahead | None = None
        self.lookahead_won = 0  # steps whose ids a lookahead had computed
        self.lookahead_lost = 0  # lookaheads computed for nothing (the next step was another)
        if graphs_wanted(self.device, self.attn_backend, engine_cfg.enforce_eager or engine_cfg.max_loras > 0):
            width = -(-min(max_model_len, num_blocks * self.block_size) // self.block_size)
            # NOTE: the graphs call back into the runner through a weak reference, so an engine that is dropped
            # frees its GPU memory at once (a runner <-> graphs cycle would wait for the garbage collector)
            runner = weakref.ref(self)

            def forward(ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
                r = runner()
                assert r is not None, "the runner of these graphs is gone"
                return r._forward_graphed(ids, positions, meta)

            self.graphs = DecodeGraphs(forward, self.device, self.block_size, self.spare_block, width,
                                       graph_buckets(engine_cfg.max_num_seqs))

    def _allocate_kv(self, num_blocks: int) -> None:
        cfg = self.cfg
        rows = kv_block_rows(self.block_size, self.kv_dtype)
        shape = (cfg.num_layers, 2, num_blocks, rows, cfg.num_kv_heads, cfg.head_dim)
        self.use_kv(host_memory.zeros(shape, self.kv_dtype, self.device, what="the KV cache (num_kv_blocks)"))

    def use_kv(self, kv: torch.Tensor) -> None:
        """`kv` as the pool ([layers, 2, blocks, rows, KVH, D]), and its per-layer K and V views the model reads."""
        self.kv = kv
        self.kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]

    def on_device(self) -> contextlib.AbstractContextManager[Any]:
        """The runner's GPU as the calling thread's current device (Triton launches and graph captures go to the
        current device, not the tensors'; an engine on cuda:1 steps from threads whose current device is 0)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def capture_graphs(self) -> None:
        """Capture the decode CUDA graphs (warm-up; a no-op without them)."""
        if self.graphs is not None and not self.graphs.graphs:
            with self.on_device():
                self.graphs.capture()

    def execute(self, batch: ScheduledBatch, layer_hook: Callable[[int], None] | None = None,
                lookahead: bool = False) -> list[list[int]]:
        with self.on_device():
            return self._execute(batch, layer_hook, lookahead)

    @torch.inference_mode()
    def _execute(self, batch: ScheduledBatch, layer_hook: Callable[[int], None] | None = None,
                 lookahead: bool = False) -> list[list[int]]:
        """Compute the batch; return the new tokens of each sequence that reached its end ([] for the others).

        A sequence with draft tokens (`spec_token_ids`, trimmed by the scheduler to what it scheduled) gets them
        verified: its tokens are the accepted drafts plus one from the model. Others get one sampled token.
        `layer_hook(i)` runs after layer i has written its K/V (layer-wise KV sending).
        `lookahead`: the engine expects the same sequences in its next step (nothing waits, nothing is drafted):
        a graphed decode step then launches that one before it syncs (`Lookahead`).
        """
        step = self.prepare(batch, graphed=layer_hook is None)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.holds(batch, step):
            sampled = ahead.sampled
            self.lookahead_won += 1
        else:
            self.lookahead_lost += ahead is not None
            logits = self.forward(batch, step, layer_hook)
            if step.meta is not None or logits is None:  # NOTE: not a graphed decode step
                return self.sample(batch, step, logits)
            sampled = self._draw(batch, step, logits)
        # NOTE: the copy to the host is queued before the lookahead and waited for by its own event: a blocking
        # read (`.tolist()` of a CUDA tensor) synchronizes the whole stream, the lookahead's step included
        host, copied = self._copy_out(sampled)
        if lookahead:
            self._ahead = self._launch_ahead(batch, step, sampled)
        out: list[list[int]] = [[] for _ in batch.seqs]
        self._to_host(batch, step.sampling, host, out, copied)  # NOTE: the step's sync; the lookahead runs meanwhile
        if self._ahead is not None:
            self._ahead.ids = [t[0] for t in out]
        return out

    def _launch_ahead(self, batch: ScheduledBatch, step: Step, sampled: SamplerOutput) -> Lookahead | None:
        """Launch the next step of this graphed decode batch (see `Lookahead`), or None where the bet would be lost
        for sure: a sequence at its last token, at the model's length, whose next slot needs a new block, with a
        grammar or penalties (they read the token not yet on the host)."""
        assert self.graphs is not None
        starts = [s + 1 for s in step.starts]
        for seq, start in zip(batch.seqs, starts):
            if (seq.grammar is not None or seq.params.has_penalties or start >= self.max_model_len
                    or seq.num_output_tokens + 1 >= seq.params.max_tokens
                    or start >= len(seq.block_table) * self.block_size):
                return None
        tables = [s.block_table for s in batch.seqs]
        hidden = self.graphs.run([0] * len(starts), starts, tables, starts, ids_on_device=sampled.token_ids)
        if hidden is None:
            return None
        logits = self.model.logits(hidden).float()
        drawn = sample(logits, [NextRow(s) for s in batch.seqs])
        return Lookahead(list(batch.seqs), starts, [t[: start // self.block_size + 1] for t, start in
                                                    zip(tables, starts)], drawn)

    def prepare(self, batch: ScheduledBatch, graphed: bool = True) -> Step:
        """The host side of a step: flat ids and positions, the rows that need logits (`layout`), and (unless a CUDA
        graph will take the step) the attention metadata, copied to the device once (`build`)."""
        return self.build(batch, layout(batch), graphed)

    def build(self, batch: ScheduledBatch, step: Step, graphed: bool = True) -> Step:
        """`step` (its `layout`) with its attention metadata and device tensors, unless a CUDA graph takes it."""
        if not (graphed and step.decode_only and self.graphs is not None and self.graphs.graphs
                and bucket_for(len(step.input_ids), self.graphs.buckets) is not None):
            step.meta = AttentionMetadata.build([s.block_table for s in batch.seqs], step.starts, batch.num_new_tokens,
                                                self.block_size, kernel=self.attn_kernel,
                                                cascade=self.attn_cascade, prefill=self.attn_prefill,
                                                backend=self.attn_backend, device=self.device)
            step.device_ids = self.to_device(step.input_ids, step.positions, step.rows)
        return step

    def forward(self, batch: ScheduledBatch, step: Step,
                layer_hook: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """The device side of a step: the forward pass (a CUDA graph's replay for a decode-only step when captured)
        and the logits of the rows that need them, [N, vocab] float32 on the device; None when no row does."""
        if step.meta is None:
            assert self.graphs is not None
            hidden = self.graphs.run(step.input_ids, step.positions, [s.block_table for s in batch.seqs],
                                     step.starts)
            assert hidden is not None
            return self.model.logits(hidden).float()  # decode-only: every row samples, in order
        assert step.device_ids is not None
        ids_t, pos_t, rows_t = step.device_ids
        hidden = self.model(ids_t, pos_t, self.kv_caches, step.meta, layer_hook)
        if not step.rows:
            return None
        return self.model.logits(hidden.index_select(0, rows_t)).float()  # [N, vocab]

    def _forward_graphed(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(ids, positions, self.kv_caches, meta)

    def sample(self, batch: ScheduledBatch, step: Step, logits: torch.Tensor | None) -> list[list[int]]:
        """Tokens from the logits: sampled rows, then verified drafts (engine/spec_decode.py)."""
        out: list[list[int]] = [[] for _ in batch.seqs]
        if logits is None:
            if self.device.type == "cuda":
                # NOTE: no sampled ids to wait for (a prompt chunk short of its end): still one sync, so the step's
                # measured time is its GPU time (the workers' step-cost fit) and not its launches
                torch.cuda.current_stream(self.device).synchronize()
            return out
        if step.sampling:
            self._to_host(batch, step.sampling, self._draw(batch, step, logits), out)
        first = len(step.sampling)
        for i in step.verifying:
            seq = batch.seqs[i]
            k = len(seq.spec_token_ids)
            out[i] = verify(logits[first : first + k + 1], seq.spec_token_ids, seq.params, seq.num_output_tokens)
            first += k + 1
        for i, pos, count in step.scoring:  # prompt logprobs (params.prompt_logprobs): position p scores token p + 1
            seq = batch.seqs[i]
            if not seq.prompt_logprobs:
                seq.prompt_logprobs.append(None)
            seq.prompt_logprobs.extend(prompt_logprobs(logits[first : first + count],
                                                       seq.token_ids[pos + 1 : pos + 1 + count],
                                                       seq.params.prompt_logprobs or 0))
            first += count
        return out

    def _draw(self, batch: ScheduledBatch, step: Step, logits: torch.Tensor) -> SamplerOutput:
        """The sampled rows' tokens (and logprobs), on the logits' device."""
        seqs = [batch.seqs[i] for i in step.sampling]
        return sample(logits[: len(step.sampling)], seqs, grammar_bitmask(seqs, logits.shape[-1]))

    def _copy_out(self, sampled: SamplerOutput) -> tuple[SamplerOutput, torch.cuda.Event | None]:
        """On CUDA: the draws' copy into pinned host memory, queued on the stream, and an event recorded after it
        (the host reads the copy once the event is done); elsewhere the draws themselves and no event."""
        if self.device.type != "cuda":
            return sampled, None

        def host(t: torch.Tensor) -> torch.Tensor:
            return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)

        lps, ids = sampled.logprobs, sampled.logprob_token_ids
        out = SamplerOutput(host(sampled.token_ids), None if lps is None else host(lps),
                            None if ids is None else host(ids))
        copied = torch.cuda.Event()
        copied.record()
        return out, copied

    @staticmethod
    def _to_host(batch: ScheduledBatch, sampling: list[int], sampled: SamplerOutput, out: list[list[int]],
                 copied: torch.cuda.Event | None = None) -> None:
        """The draws into `out` (by batch index) and the sequences' logprobs (`copied`: the event after their copy
        to the host, `_copy_out`)."""
        # NOTE: the sampler keeps the draws on the logits' device; this is the step's one sync with the host
        if copied is not None:
            copied.synchronize()
        tokens = sampled.token_ids.tolist()
        lps = sampled_logprobs(tokens, sampled.logprobs, sampled.logprob_token_ids,
                               [batch.seqs[i].params.logprobs for i in sampling])
        for i, tok, lp in zip(sampling, tokens, lps):
            out[i] = [tok]
            if lp is not None:
                batch.seqs[i].new_logprobs.append(lp)

    def to_device(self, *parts: list[int]) -> list[torch.Tensor]:
        """int64 lists as tensors on the runner's device: one host buffer (pinned on CUDA), one non_blocking copy,
        then views of it (on the CPU, the host buffer's views themselves)."""
        lengths = [len(p) for p in parts]
        host = torch.tensor([x for p in parts for x in p], dtype=torch.long)  # [sum(lengths)]
        return list(pack([host], self.device).tensors[0].split(lengths))

    @torch.inference_mode()
    def read_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V of `block_ids` in `layer`: each [n, block_size, KVH, D] (int8: with the scale row), on
        the runner's device."""
        (idx,) = self.to_device(block_ids)
        return self.kv[layer, 0].index_select(0, idx), self.kv[layer, 1].index_select(0, idx)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K and V in every layer (a forked sequence's copy-on-write block)."""
        self.kv[:, :, dst] = self.kv[:, :, src]

    @torch.inference_mode()
    def write_blocks(self, layer: int, which: int, block_ids: list[int], kv: torch.Tensor) -> None:
        """Store K (which=0) or V (1), [n, block_size, KVH, D] from any device, into `block_ids` of `layer`."""
        (idx,) = self.to_device(block_ids)
        self.kv[layer, which].index_copy_(0, idx, kv.to(device=self.device, dtype=self.kv_dtype))
