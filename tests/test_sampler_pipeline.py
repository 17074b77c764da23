"""The sampler's pipeline as a user sees it: penalties and filters as vLLM defines them, logit_bias, the grammar
bitmask, and logprobs (the chosen and top-k tokens) equal to transformers' on the same model."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.sampler import apply_token_bitmask, sample
from tests.helpers import Row, make_engine, random_prompts, run_alone, run_to_completion

LOGITS = torch.tensor([[0.5, 2.0, -1.0, 1.5, 0.0, 1.0, -3.0, 0.2, 0.9, -0.5]])  # top: 1, then 3


def greedy_pick(params: SamplingParams, history: list[int], logits: torch.Tensor = LOGITS,
                num_prompt_tokens: int = 1) -> int:
    return int(sample(logits, [Row(params, history, num_prompt_tokens)]).token_ids[0])


def test_repetition_penalty_equals_transformers_processor():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    history = [4, 9, 9, 17, 30, 41]  # prompt [4, 9], output [9, 17, 30, 41]
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([history]), logits.clone())
    # the k-th best token after the penalty is what the sampler picks once the better ones are banned
    for k in range(5):
        banned = {int(t): -100.0 for t in ref[0].argsort(descending=True)[:k]}
        params = SamplingParams(temperature=0, repetition_penalty=1.7, logit_bias=banned)
        assert greedy_pick(params, history, logits, num_prompt_tokens=2) == int(ref[0].argsort(descending=True)[k])


@pytest.mark.parametrize("field, value, history, expected", [
    ("presence_penalty", 0.6, [0, 1], 3),  # 2.0 - 0.6 = 1.4 < 1.5
    ("presence_penalty", 0.4, [0, 1], 1),  # 1.6 > 1.5
    ("frequency_penalty", 0.3, [0, 1], 1),  # one occurrence: 1.7
    ("frequency_penalty", 0.3, [0, 1, 1], 3),  # two: 1.4
    ("frequency_penalty", 0.3, [1, 0], 1),  # only the output counts: token 1 is the prompt
    ("repetition_penalty", 1.5, [1, 0], 3),  # prompt tokens count: 2.0 / 1.5 < 1.5
])
def test_penalties_follow_vllms_definitions(field, value, history, expected):
    assert greedy_pick(SamplingParams(temperature=0, **{field: value}), history) == expected


def test_logit_bias_and_bitmask_move_the_greedy_choice():
    assert greedy_pick(SamplingParams(temperature=0, logit_bias={6: 5.5}), [0]) == 6
    mask = torch.tensor([[0b1111111111 & ~(1 << 1) & ~(1 << 3)]], dtype=torch.int32)  # ban 1 and 3
    assert int(sample(LOGITS, [Row(SamplingParams(temperature=0), [0])], bitmask=mask).token_ids[0]) == 5
    assert torch.isinf(apply_token_bitmask(LOGITS, mask)[0, [1, 3]]).all()


def test_min_p_drops_tokens_below_its_share_of_the_top():
    params = [SamplingParams(temperature=1.0, min_p=0.5, seed=s) for s in range(2000)]
    tokens = sample(LOGITS.expand(len(params), -1).contiguous(), [Row(p, [0]) for p in params]).token_ids
    # p_i >= 0.5 p_max  <=>  logit_i >= 2.0 - ln 2 = 1.31: only tokens 1 and 3
    assert set(tokens.tolist()) == {1, 3}


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("min_p", 1.5),
    ("logit_bias", {5: 200.0}), ("logprobs", 21), ("prompt_logprobs", -1), ("n", 0),
])
def test_out_of_range_fields_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.field == field


def test_penalised_greedy_decoding_matches_transformers_generate(smollm2, hf_smollm2):
    prompt = random_prompts(1, [20], seed=81)[0]
    ours = run_alone(smollm2, prompt, SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3,
                                                     ignore_eos=True))
    ref = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, repetition_penalty=1.3,
                              min_new_tokens=12)[0, len(prompt):].tolist()
    assert ours == ref
    plain = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                min_new_tokens=12)[0, len(prompt):].tolist()
    assert ours != plain  # the penalty changed the answer


def test_logprobs_equal_transformers_for_sampled_and_prompt_tokens(smollm2, hf_smollm2):
    prompt = random_prompts(1, [14], seed=82)[0]
    engine = make_engine(smollm2)
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=5, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    engine.add_request("lp", prompt, params)
    outs: list = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    tokens = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in o.new_logprobs]
    assert len(lps) == len(tokens) == 6 and [lp.token_id for lp in lps] == tokens
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)  # [L, V]
    for j, lp in enumerate(lps):
        row = ref[len(prompt) - 1 + j]
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        top = row.topk(5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert max(abs(v - float(r)) for (_, v), r in zip(lp.top, top.values)) < 1e-4
    plp = outs[0].prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for p, entry in enumerate(plp[1:], start=1):
        assert entry is not None and entry.token_id == prompt[p]
        assert abs(entry.logprob - float(ref[p - 1, prompt[p]])) < 1e-4
        assert [t for t, _ in entry.top] == ref[p - 1].topk(3).indices.tolist()
    assert run_to_completion(engine) == {}


def test_n_choices_fork_from_one_prefill_and_equal_separate_runs(tiny):
    prompt = random_prompts(1, [37], seed=83)[0]  # 3 blocks of 16: two shared, the third copied per choice
    engine = make_engine(tiny)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True, n=3)
    free = engine.block_manager.num_free_blocks
    engine.add_request("n", prompt, params)
    outs = {o.request_id: o for o in engine.step()}  # the prompt, and the fork
    assert list(outs) == ["n"] and free - engine.block_manager.num_free_blocks == 3 + 2  # not 3 x 3
    final = run_to_completion(engine)
    assert sorted(final) == ["n", "n-1", "n-2"]
    # the prompt computed once; each other choice recomputes its last prompt token, then decodes
    assert engine.stats().computed_tokens == 37 + 5 + 2 * (1 + 5)
    for i, rid in enumerate(["n", "n-1", "n-2"]):
        alone = run_alone(tiny, prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=5 + i, ignore_eos=True))
        assert final[rid].token_ids == alone, rid
    assert len({tuple(o.token_ids) for o in final.values()}) == 3
