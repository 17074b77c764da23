"""The one block-hash function: the same in every process, chained, scoped by model and dtype, full blocks only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.block_hash import cache_scope, hash_block_tokens, hash_prompt_blocks, root_hash
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from tests.helpers import make_engine

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BS = 16
SCOPE = cache_scope("smollm2-135m", "float32")
TOKENS = [(i * 7919) % 49152 for i in range(5 * BS + 3)]  # 5 full blocks and 3 tokens

CHILD = f"""
from engine.block_hash import hash_prompt_blocks
print(" ".join(h.hex() for h in hash_prompt_blocks({TOKENS!r}, {BS}, {SCOPE!r})))
"""


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_hashes_are_identical_in_another_process(hash_seed):
    """NOTE: Python's hash() is salted per process (PYTHONHASHSEED); block hashes must not depend on it."""
    env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=60)
    ours = [h.hex() for h in hash_prompt_blocks(TOKENS, BS, SCOPE)]
    assert out.stdout.split() == ours
    assert len(ours) == 5 and len(set(ours)) == 5


def test_changing_a_token_in_block_0_changes_every_later_hash():
    changed = list(TOKENS)
    changed[3] += 1
    before, after = hash_prompt_blocks(TOKENS, BS, SCOPE), hash_prompt_blocks(changed, BS, SCOPE)
    assert all(a != b for a, b in zip(before, after))


def test_changing_a_token_in_a_later_block_keeps_the_earlier_hashes():
    changed = list(TOKENS)
    changed[2 * BS] += 1
    before, after = hash_prompt_blocks(TOKENS, BS, SCOPE), hash_prompt_blocks(changed, BS, SCOPE)
    assert before[:2] == after[:2]
    assert all(a != b for a, b in zip(before[2:], after[2:]))


def test_hash_chains_each_block_to_its_parent():
    hashes = hash_prompt_blocks(TOKENS, BS, SCOPE)
    parent = root_hash(SCOPE)
    for i, h in enumerate(hashes):
        assert h == hash_block_tokens(parent, TOKENS[i * BS : (i + 1) * BS], SCOPE)
        parent = h
    # the same block tokens under another parent hash to something else
    assert hash_block_tokens(root_hash(SCOPE), TOKENS[BS : 2 * BS], SCOPE) != hashes[1]


@pytest.mark.parametrize("other_scope", [cache_scope("another-model", "float32"),
                                         cache_scope("smollm2-135m", "bfloat16")], ids=["model_id", "dtype"])
def test_other_model_id_or_dtype_gives_other_hashes(other_scope):
    ours, theirs = hash_prompt_blocks(TOKENS, BS, SCOPE), hash_prompt_blocks(TOKENS, BS, other_scope)
    assert len(ours) == len(theirs) == 5
    assert not set(ours) & set(theirs)


def test_engine_scope_depends_on_kv_dtype(tiny):
    fp32, bf16 = make_engine(tiny, num_blocks=4), make_engine(tiny, num_blocks=4, dtype="bfloat16")
    assert fp32.scope != bf16.scope
    assert tiny.config.model_id in fp32.scope and tiny.config.model_id in bf16.scope


@pytest.mark.parametrize(("num_tokens", "num_hashes"), [(0, 0), (BS - 1, 0), (BS, 1), (2 * BS + 5, 2), (3 * BS, 3)])
def test_only_full_blocks_get_hashes(num_tokens, num_hashes):
    hashes = hash_prompt_blocks(TOKENS[:num_tokens], BS, SCOPE)
    assert len(hashes) == num_hashes
    assert hashes == hash_prompt_blocks(TOKENS, BS, SCOPE)[:num_hashes]  # a partial tail changes nothing


def test_sequence_hashes_match_the_shared_function_and_refuse_partial_blocks():
    seq = Sequence("r", TOKENS, SamplingParams(temperature=0.0), BS, SCOPE)
    assert seq.block_hashes(5) == hash_prompt_blocks(TOKENS, BS, SCOPE)
    with pytest.raises(AssertionError, match="only full blocks"):
        seq.block_hash(5)


def test_extra_keys_change_every_hash_and_none_leaves_them_as_they_were():
    """A LoRA adapter's key (the block hash's extra keys, as vLLM's): other hashes for every block, and the base
    model's (no extra keys) exactly the hashes before extra keys existed, which the router and the index compute."""
    base = hash_prompt_blocks(TOKENS, BS, SCOPE)
    assert hash_prompt_blocks(TOKENS, BS, SCOPE, extra_keys="") == base
    a = hash_prompt_blocks(TOKENS, BS, SCOPE, extra_keys="lora:a:0123")
    b = hash_prompt_blocks(TOKENS, BS, SCOPE, extra_keys="lora:b:0123")
    assert len(a) == len(b) == 5
    assert not set(a) & set(base) and not set(a) & set(b)
    parent = root_hash(SCOPE)
    assert hash_block_tokens(parent, TOKENS[:BS], SCOPE, "lora:a:0123") == a[0]
    seq = Sequence("r", TOKENS, SamplingParams(), BS, SCOPE, extra_keys="lora:a:0123")
    assert seq.block_hashes(5) == a
