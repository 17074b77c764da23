"""What a CUDA graph of a decode step replays, checked on the CPU: the buckets' static buffers (ids, positions and
the triton metadata, padded to the bucket with rows that write and read only the runner's spare KV block) give the
eager engine's greedy tokens. Without CUDA the Triton kernels run under the interpreter and the forward over the
static buffers runs eagerly (engine/cuda_graphs.py); the graphs themselves: tests/test_engine_gpu.py (gpu)."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
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
    r.graphs = DecodeGraphs(r._forward_graphed, r.device, r.block_size, r.spare_block, 32, graph_buckets(8))
    r.capture_graphs()
    assert sorted(r.graphs.graphs) == [1, 2, 4, 8]
    # NOTE: 32 blocks wide: two key ranges per row (split-KV), the second empty for these short sequences
    assert {g.meta.triton.num_splits for g in r.graphs.graphs.values()} == {2}
    runs: list[int] = []
    real = r.graphs.run

    def counting(ids: list[int], *args: object, **kwargs: object) -> torch.Tensor | None:
        runs.append(len(ids))
        return real(ids, *args, **kwargs)  # type: ignore[arg-type]

    r.graphs.run = counting  # type: ignore[method-assign]
    r.kv[:, :, r.spare_block].zero_()
    for n in (1, 3, 5):  # 3 and 5 pad to the buckets 4 and 8
        prompts = random_prompts(n, [9 + 4 * i for i in range(n)], vocab=tiny.config.vocab_size, seed=n)
        assert greedy_outputs(engine, prompts, 5) == greedy_outputs(eager, prompts, 5)
    assert {3, 5} <= set(runs)  # decode steps took the static buffers, padded ones among them
    assert r.kv[:, :, r.spare_block].abs().sum() > 0  # the padded rows wrote into the spare block, nowhere else


def _graphed(tiny, monkeypatch, **cfg):
    """An engine whose decode steps take the buckets' static buffers (the CPU stand-in for its CUDA graphs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv(ENV, "triton")
    engine = make_engine(tiny, **cfg)
    r = engine.runner
    r.graphs = DecodeGraphs(r._forward_graphed, r.device, r.block_size, r.spare_block, 32, graph_buckets(4))
    r.capture_graphs()
    return engine


def _drive(engine, vocab: int) -> dict[str, list]:
    """Requests that join, end and are aborted mid-way, with logprobs, seeded sampling and penalties among them:
    every output of every step, by request id."""
    prompts = random_prompts(5, [9, 14, 6, 11, 7], vocab=vocab, seed=29)
    params = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)]
    seen: dict[str, list] = {}
    engine.add_request("r0", prompts[0], params[0])
    engine.add_request("r1", prompts[1], params[1])
    for i in range(40):
        if i == 3:  # NOTE: joins two decode steps in: the lookahead bet on r0 and r1 alone is lost
            engine.add_request("r2", prompts[2], params[2])
        if i == 9:
            engine.abort_request("r1")
        if i == 10:
            engine.add_request("r3", prompts[3], params[3])
            engine.add_request("r4", prompts[4], params[4])
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(
                (out.new_token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs], out.finished))
        if i > 10 and not engine.has_unfinished_requests():
            break
    return seen


@pytest.mark.skipif(CUDA, reason="the CPU stand-in; on CUDA tests/test_engine_gpu.py replays real graphs")
def test_the_decode_lookahead_gives_every_step_the_outputs_of_one_step_at_a_time(tiny, monkeypatch):
    """model_runner.Lookahead: each graphed decode step launches the next one before its ids reach the host. With
    requests that join (a lost bet), end at max_tokens, are aborted, sample with a seed and ask for logprobs, or set
    penalties (no lookahead while one runs), every step's outputs are those of the same engine one step at a time,
    bit for bit, and its tokens the eager engine's (whose attention kernel rounds differently)."""
    cfg = dict(num_blocks=64, max_num_seqs=4, enable_prefix_caching=False)
    vocab = tiny.config.vocab_size
    off = _graphed(tiny, monkeypatch, decode_lookahead=False, **cfg)
    ref = _drive(off, vocab)
    assert (off.runner.lookahead_won, off.runner.lookahead_lost) == (0, 0)
    engine = _graphed(tiny, monkeypatch, **cfg)
    assert _drive(engine, vocab) == ref
    r = engine.runner
    assert r.lookahead_won >= 6 and r.lookahead_lost >= 2  # NOTE: lost: r1's abort, r3 and r4's arrival
    assert engine.stats().num_free_blocks == engine.stats().num_blocks

    def tokens(seen: dict[str, list]) -> dict[str, list[list[int]]]:
        return {rid: [ids for ids, _, _ in outs] for rid, outs in seen.items()}

    assert tokens(_drive(make_engine(tiny, **cfg), vocab)) == tokens(ref)
