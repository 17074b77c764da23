"""Tensor parallelism (engine/parallel/): shards, TP 2 and TP 4 engine groups (gloo, CPU, float32) against TP 1, and a
rank that dies.

The models are the tiny random model (logits far apart: greedy near-ties are rare) in two head layouts:
8 query / 4 KV heads (TP 2 and 4 split the KV heads) and the default 4 / 2 (TP 4 replicates each KV head on 2 ranks),
and the first with Llama's q/k/v/o biases.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.errors import InvalidRequestError
from engine.loader import LoadedModel, tiny_model, tiny_model_config
from engine.model_runner import ModelRunner
from engine.parallel import check_tp, rank_config, shard_weights
from engine.parallel.group import Rendezvous, RowParallel
from engine.parallel.launch import FollowerGroup, Followers, TPGroupError
from engine.parallel.runner import TPModelRunner
from engine.quality import sequence_logits
from tests.helpers import generate_ids, random_prompts, run_to_completion

NEAR_TIE = 1e-3  # top-2 logit gap under which float32 sums in another order may pick the other token
N_TOKENS = 32
LAYOUTS = {"gqa-8q-4kv": dict(num_heads=8, num_kv_heads=4, head_dim=8), "tiny-4q-2kv": {},
           # NOTE: Llama's attention_bias: q/k/v biases split with their rows, o's added once (rank 0's)
           "biased": dict(num_heads=8, num_kv_heads=4, head_dim=8, attention_bias=True, attention_out_bias=True),
           # NOTE: a tied LM head cut from the embedding, over a vocabulary no TP size here divides (the last rank's
           # slice is short, padded for the gather)
           "tied-odd-vocab": dict(tie_word_embeddings=True, vocab_size=49155)}


@pytest.fixture(scope="module")
def models() -> dict[str, LoadedModel]:
    return {name: tiny_model(**overrides) for name, overrides in LAYOUTS.items()}


def engine(loaded: LoadedModel, tp: int) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_blocks=256, max_num_batched_tokens=256, num_threads=1,
                                          tensor_parallel_size=tp))


@pytest.fixture
def tp2(models: dict[str, LoadedModel]) -> Iterator[LLMEngine]:
    eng = engine(models["gqa-8q-4kv"], 2)
    yield eng
    eng.close()


# ---- shards (no processes) --------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout,tp", [("gqa-8q-4kv", 2), ("gqa-8q-4kv", 4), ("tiny-4q-2kv", 4),
                                       ("tied-odd-vocab", 4)])
def test_shards_put_back_together_are_the_weights(models: dict[str, LoadedModel], layout: str, tp: int) -> None:
    loaded = models[layout]
    cfg, w = loaded.config, loaded.weights
    shards = [shard_weights(cfg, w, r, tp) for r in range(tp)]
    p = "model.layers.1."
    for name, dim in (("self_attn.q_proj.weight", 0), ("mlp.gate_proj.weight", 0), ("mlp.up_proj.weight", 0),
                      ("self_attn.o_proj.weight", 1), ("mlp.down_proj.weight", 1)):
        assert torch.equal(torch.cat([s[p + name] for s in shards], dim=dim), w[p + name]), name
    local = rank_config(cfg, tp)
    kv_rows = local.num_kv_heads * cfg.head_dim
    for name in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
        assert all(s[p + name].shape[0] == kv_rows for s in shards)
        if tp <= cfg.num_kv_heads:
            assert torch.equal(torch.cat([s[p + name] for s in shards]), w[p + name])
        else:  # replicated: the ranks whose query heads read KV head j hold it
            group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
            for r, s in enumerate(shards):
                head = r * local.num_heads // group
                assert torch.equal(s[p + name], w[p + name][head * kv_rows : (head + 1) * kv_rows])
    # the LM head by vocabulary rows (a tied one cut from the embedding), the embedding replicated (not copied)
    head = w["model.embed_tokens.weight"] if cfg.tie_word_embeddings else w["lm_head.weight"]
    assert torch.equal(torch.cat([s["lm_head.weight"] for s in shards]), head)
    assert all(s["model.embed_tokens.weight"] is w["model.embed_tokens.weight"] for s in shards)
    assert not local.tie_word_embeddings


def test_tp_sizes_the_model_cannot_split_are_refused_naming_the_field() -> None:
    cfg = tiny_model_config(num_heads=6, num_kv_heads=3, head_dim=8, hidden_size=48)
    for tp, what in ((4, "attention heads"), (2, "KV heads")):
        with pytest.raises(InvalidRequestError, match=f"tensor_parallel_size: {tp} must divide .*{what}") as e:
            check_tp(cfg, tp)
        assert e.value.field == "tensor_parallel_size"
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size: must be a positive integer"):
        EngineConfig(tensor_parallel_size=0)


def test_tp1_keeps_the_plain_runner(models: dict[str, LoadedModel]) -> None:
    eng = engine(models["gqa-8q-4kv"], 1)
    assert type(eng.runner) is ModelRunner  # no group, no all-reduce, no wrapper
    assert not any(isinstance(layer.o, RowParallel) or isinstance(layer.down, RowParallel)
                   for layer in eng.runner.model.layers)


# ---- engine groups ----------------------------------------------------------------------------------------------
def assert_same_or_near_tie(ref_engine: LLMEngine, prompts: list[list[int]], ref: list[list[int]],
                            ours: list[list[int]]) -> None:
    """Every continuation equal to TP 1's, or diverging where TP 1's top-2 logits nearly tie (gap reported)."""
    for prompt, a, b in zip(prompts, ref, ours):
        if a == b:
            continue
        j = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        top2 = torch.topk(sequence_logits(ref_engine, prompt + a[:j])[-1], 2).values
        gap = float(top2[0] - top2[1])
        print(f"TP diverged from TP 1 at token {j}: logit gap {gap:.2e}")
        assert gap < NEAR_TIE, f"diverged at token {j} with top-2 gap {gap:.2e}: TP 1 {a} vs TP {b}"


@pytest.mark.parametrize("layout,tp", [("gqa-8q-4kv", 2), ("gqa-8q-4kv", 4), ("tiny-4q-2kv", 4), ("biased", 2),
                                       ("tied-odd-vocab", 2)],
                         ids=["tp2", "tp4", "tp4-kv-replicated", "tp2-biases", "tp2-tied-head-odd-vocab"])
def test_greedy_tokens_equal_tp1(models: dict[str, LoadedModel], layout: str, tp: int) -> None:
    loaded = models[layout]
    prompts = random_prompts(8, [5, 17, 33, 48, 9, 64, 21, 40], vocab=loaded.config.vocab_size, seed=tp)
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    ref_engine = engine(loaded, 1)
    ref = generate_ids(ref_engine, prompts, params)
    group = engine(loaded, tp)
    try:
        ours = generate_ids(group, prompts, params)  # one continuous batch: prefill chunks and decode mixed
        # NOTE: then a prompt extending one already served (its blocks come from the prefix cache on every rank)
        longer = [prompts[0] + ref[0] + prompts[1]]
        cached = generate_ids(group, longer, params, prefix="again")
        assert group.stats().cached_prompt_tokens > 0
    finally:
        group.close()
    assert_same_or_near_tie(ref_engine, prompts, ref, ours)
    assert_same_or_near_tie(ref_engine, longer, generate_ids(ref_engine, longer, params, prefix="again"), cached)


def test_logprobs_of_the_gathered_logits_equal_tp1(models: dict[str, LoadedModel]) -> None:
    """Rank 0 samples from logits gathered from every rank's vocabulary columns: sampled and prompt logprobs (a
    70-token prompt's rows pass a shared-memory slot: gloo's gather) equal TP 1's, for a tied head over an odd
    vocabulary too."""
    for layout in ("gqa-8q-4kv", "tied-odd-vocab"):
        loaded = models[layout]
        prompt = random_prompts(1, [70], vocab=loaded.config.vocab_size, seed=3)[0]
        params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, prompt_logprobs=2, ignore_eos=True)
        outs = []
        for tp in (1, 2):
            eng = engine(loaded, tp)
            try:
                eng.add_request("lp", prompt, params)
                steps = [o for _ in range(50) if eng.has_unfinished_requests() for o in eng.step()]
            finally:
                eng.close()
            outs.append(([lp for o in steps for lp in o.new_logprobs], steps[0].prompt_logprobs))
        (ref_lps, ref_plp), (lps, plp) = outs
        assert [lp.token_id for lp in lps] == [lp.token_id for lp in ref_lps] and len(lps) == 4
        assert ref_plp is not None and plp is not None and len(plp) == len(ref_plp) == len(prompt)
        for a, b in [*zip(ref_lps, lps), *zip(ref_plp[1:], plp[1:])]:
            assert a is not None and b is not None and a.token_id == b.token_id
            assert abs(a.logprob - b.logprob) < 1e-4 and [t for t, _ in a.top] == [t for t, _ in b.top]


def test_speculative_drafts_are_verified_on_every_rank(models: dict[str, LoadedModel]) -> None:
    from tests.test_spec_decode import SPEC, Oracle

    loaded = models["gqa-8q-4kv"]
    prompts = random_prompts(2, [20, 37], vocab=1000, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = generate_ids(engine(loaded, 1), prompts, params)
    group = LLMEngine(loaded, EngineConfig(num_blocks=256, num_threads=1, tensor_parallel_size=2,
                                           speculative_config=SPEC))  # type: ignore[arg-type]
    # NOTE: drafts of the known continuation with every third token wrong: each step accepts some, rejects others
    group.proposer = Oracle({tuple(p): c for p, c in zip(prompts, ref)})  # type: ignore[assignment]
    try:
        ours = generate_ids(group, prompts, params)
        stats = group.stats()
    finally:
        group.close()
    assert ours == ref and 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_preempted_sequences_recompute_on_every_rank(models: dict[str, LoadedModel]) -> None:
    loaded = models["gqa-8q-4kv"]
    prompts = random_prompts(6, [30, 41, 25], vocab=loaded.config.vocab_size, seed=11)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    out = {}
    for tp in (1, 2):  # NOTE: 16 blocks for ~30 needed: rank 0's scheduler preempts, every rank recomputes
        eng = LLMEngine(loaded, EngineConfig(num_blocks=16, max_num_batched_tokens=256, num_threads=1,
                                             tensor_parallel_size=tp))
        try:
            out[tp] = generate_ids(eng, prompts, params)
            assert eng.stats().num_preemptions > 0
        finally:
            eng.close()
    assert out[2] == out[1]


def test_forked_choices_copy_their_block_on_every_rank(models: dict[str, LoadedModel], tp2: LLMEngine) -> None:
    prompt = random_prompts(1, [37], seed=5)[0]  # NOTE: its last block is partly full: n = 2 copies it (CoW)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2)
    ref = engine(models["gqa-8q-4kv"], 1)
    outs = []
    for eng in (ref, tp2):
        eng.add_request("fork", prompt, params)
        outs.append({rid: out.token_ids for rid, out in run_to_completion(eng).items()})
    assert outs[0] == outs[1] and set(outs[0]) == {"fork", "fork-1"}


def test_the_engine_starts_its_followers_with_the_launcher_it_is_given(models: dict[str, LoadedModel]) -> None:
    """The seam a cluster hosts its ranks through (Ray actors: cluster/tp_ranks.py); here the process launcher."""
    started: list[list[str]] = []

    def launch(rdv: Rendezvous, cfg: Any, rank_cfgs: list[EngineConfig], shards: list[dict[str, torch.Tensor]],
               num_blocks: int, max_model_len: int, /) -> FollowerGroup:
        started.append([c.device for c in rank_cfgs])
        return Followers(rdv, cfg, rank_cfgs, shards, num_blocks, max_model_len)

    loaded = models["gqa-8q-4kv"]
    prompts = random_prompts(2, [9, 30], vocab=loaded.config.vocab_size, seed=11)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    group = LLMEngine(loaded, EngineConfig(num_blocks=64, num_threads=1, tensor_parallel_size=2),
                      launch_followers=launch)
    try:
        assert isinstance(group.runner, TPModelRunner) and started == [["cpu"]]
        assert len(group.runner.followers.pids()) == 1
        ours = generate_ids(group, prompts, params)
    finally:
        group.close()
    ref_engine = engine(loaded, 1)
    assert_same_or_near_tie(ref_engine, prompts, generate_ids(ref_engine, prompts, params), ours)


def test_what_reads_one_processs_model_refuses_a_group(tp2: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError, match="tensor_parallel_size"):
        sequence_logits(tp2, [101, 102, 103])  # NOTE: outside a step the followers would never join it


def test_a_dead_rank_fails_the_group_with_an_error_naming_it(tp2: LLMEngine) -> None:
    assert isinstance(tp2.runner, TPModelRunner)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    tp2.add_request("a", random_prompts(1, [20], seed=7)[0], params)
    tp2.step()  # the prompt: both ranks computed it
    pid = tp2.runner.followers.procs[0].process.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(TPGroupError, match=rf"group of 2 failed: rank 1 \(pid {pid}\): killed by SIGKILL"):
        while tp2.has_unfinished_requests():
            tp2.step()
    with pytest.raises(TPGroupError, match="rank 1"):  # NOTE: and every later step, at once (no collective)
        tp2.step()


def test_the_tp_bench_reports_step_times_and_the_all_reduce_share(tmp_path) -> None:
    import argparse
    import json

    from pdcluster.bench.engine import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    out = tmp_path / "tp.json"
    args = p.parse_args(["--model", "tiny", "--tensor-parallel-size", "2", "--prefill-len", "32",
                         "--decode-prompt-len", "16", "--tp-batches", "1,2", "--tp-rounds", "1", "--out", str(out)])
    assert run(args) == 0
    r = json.loads(out.read_text())
    assert r["tensor_parallel_size"] == 2 and r["allreduces_per_step"] == 2 * tiny_model_config().num_layers
    assert r["allreduce"] == "shm"  # NOTE: CPU ranks of one host (engine/parallel/shm_allreduce.py)
    assert r["step_messages"] == "pipe"  # NOTE: engine/parallel/step_channel.py
    steps = {"prefill 32", "decode step, batch 1", "decode step, batch 2"}
    assert set(r["cases"]) == steps | {"KV read 32 tokens", "KV write 32 tokens"}
    for case, row in r["cases"].items():
        assert row["tp1_ms"] > 0 and row["tp2_ms"] > 0
        if case in steps:
            assert 0 < row["allreduce_share"] < 1 and row["allreduce_ms_per_call"] > 0


def test_a_70b_model_shards_over_8_ranks_one_kv_head_each() -> None:
    from engine.loader import load_model

    # NOTE: on the meta device: the whole model's shapes, no memory
    loaded = load_model("random:llama-3.1-70b", device=torch.device("meta"), dtype="bfloat16")
    cfg = loaded.config
    local = rank_config(cfg, 8)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (8, 1, 3584)
    shard = shard_weights(cfg, loaded.weights, 3, 8)
    p = "model.layers.79."
    assert shard[p + "self_attn.q_proj.weight"].shape == (8 * 128, 8192)
    assert shard[p + "self_attn.k_proj.weight"].shape == (128, 8192)
    assert shard[p + "self_attn.o_proj.weight"].shape == (8192, 8 * 128)
    assert shard[p + "mlp.down_proj.weight"].shape == (8192, 3584)
