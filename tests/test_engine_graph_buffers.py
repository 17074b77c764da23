"""What a CUDA graph of a decode step replays, checked on the CPU: the buckets' static buffers (ids, positions and
the triton metadata, padded to the bucket with rows that write and read only the runner's spare KV block) give the
eager engine's greedy tokens. Without CUDA the Triton kernels run under the interpreter and the forward over the
static buffers runs eagerly (engine/cuda_graphs.py); the graphs themselves: tests/test_engine_gpu.py (gpu)."""

from __future__ import annotations

import pytest
import torch

from engine.cuda_graphs import DecodeGraphs, graph_buckets
from engine.kernels import ENV
from engine.quality import greedy_outputs
from tests.helpers import import_triton_module, make_engine, random_prompts

# NOTE: as tests/test_triton_attention.py: the interpreter must be on when the kernels module is first imported.
CUDA = torch.cuda.is_available()
import_triton_module("engine.attention.triton_kernels")


@pytest.mark.skipif(CUDA, reason="the CPU stand-in; on CUDA tests/test_engine_gpu.py replays real graphs")
def test_decode_over_the_buckets_static_buffers_gives_the_eager_tokens_and_pads_into_the_spare_block(tiny,
                                                                                                    monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(ENV, "triton")
    cfg = dict(num_blocks=64, max_num_seqs=8, enable_prefix_caching=False)
    eager = make_engine(tiny, **cfg)
    engine = make_engine(tiny, **cfg)
    r = engine.runner
    assert r.attn_backend == "triton" and r.graphs is None  # NOTE: graphs are only made on CUDA
    r.graphs = DecodeGraphs(r._forward_graphed, r.device, r.block_size, r.spare_block, 64, graph_buckets(8))
    r.capture_graphs()
    assert sorted(r.graphs.graphs) == [1, 2, 4, 8]
    runs: list[int] = []
    real = r.graphs.run

    def counting(ids: list[int], *args: object) -> torch.Tensor | None:
        runs.append(len(ids))
        return real(ids, *args)  # type: ignore[arg-type]

    r.graphs.run = counting  # type: ignore[method-assign]
    r.kv[:, :, r.spare_block].zero_()
    for n in (1, 3, 5):  # 3 and 5 pad to the buckets 4 and 8
        prompts = random_prompts(n, [9 + 4 * i for i in range(n)], vocab=tiny.config.vocab_size, seed=n)
        assert greedy_outputs(engine, prompts, 5) == greedy_outputs(eager, prompts, 5)
    assert {3, 5} <= set(runs)  # decode steps took the static buffers, padded ones among them
    assert r.kv[:, :, r.spare_block].abs().sum() > 0  # the padded rows wrote into the spare block, nowhere else
