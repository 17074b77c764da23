"""The KV seam on the real SmolLM2 weights: prefill in engine A, export, import in engine B, decode on.

A request split across two engines (or two processes) must give exactly the tokens of one engine alone;
an export is checked in full before B writes a byte, and B links the blocks it already caches.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import pickle
import traceback
from collections.abc import Callable

import pytest
import torch

from engine import CapacityError, InvalidRequestError, KVExport, LLMEngine, SamplingParams
from engine.block_hash import BlockHash, cache_scope, hash_prompt_blocks
from engine.config import ModelConfig
from engine.loader import LoadedModel
from tests.helpers import assert_idle, greedy, make_engine, random_prompts, run_alone, run_to_completion

BS = 16
N = 8
PROMPT = random_prompts(1, [45], seed=31)[0]  # 2 full blocks + 13 tokens
SHARED = random_prompts(1, [256], seed=32)[0]  # 16 full blocks
LONG = SHARED + random_prompts(1, [19], seed=33)[0]  # 275 tokens: 18 blocks
FIRST_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
SEEDED = {"temperature": 0.8, "seed": 7}


def smol_engine(loaded: LoadedModel, **overrides: object) -> LLMEngine:
    return make_engine(loaded, **{"num_blocks": 64, **overrides})


def block_bytes(cfg: ModelConfig) -> int:
    """K and V of one fp32 block in every layer, from the model's shape."""
    return 2 * cfg.num_layers * BS * cfg.num_kv_heads * cfg.head_dim * 4


def prefill_and_hold(a: LLMEngine, request_id: str, prompt: list[int], first: SamplingParams) -> list[int]:
    """Run the prefill on A; the request finishes after its first token and keeps its blocks."""
    a.add_request(request_id, prompt, first, hold_kv=True)
    out = run_to_completion(a)[request_id]
    assert out.finish_reason == "length" and len(out.token_ids) == 1
    s = a.stats()
    assert s.num_held == 1 and s.num_free_blocks == s.num_blocks - -(-len(prompt) // BS)
    return out.token_ids


def export_and_release(a: LLMEngine, request_id: str, skip_blocks: int = 0) -> KVExport:
    kv = a.export_kv(request_id, skip_blocks)
    a.release_kv(request_id)
    assert_idle(a)
    return kv


def decode(b: LLMEngine, kv: KVExport, params: SamplingParams) -> list[int]:
    b.import_kv(kv, params)
    tokens = run_to_completion(b)[kv.request_id].token_ids
    assert_idle(b)
    return tokens


@pytest.fixture(scope="module")
def ref_greedy(smollm2) -> list[int]:
    return run_alone(smollm2, PROMPT, greedy(N), num_blocks=64)


@pytest.fixture(scope="module")
def ref_long(smollm2) -> list[int]:
    return run_alone(smollm2, LONG, greedy(N), num_blocks=64)


@pytest.fixture(scope="module")
def prompt_kv(smollm2) -> KVExport:
    """PROMPT prefilled on an engine of its own and exported (A is back at baseline)."""
    a = smol_engine(smollm2)
    prefill_and_hold(a, "x", PROMPT, FIRST_GREEDY)
    return export_and_release(a, "x")


def test_decode_on_another_engine_continues_the_tokens_of_one_engine(smollm2, ref_greedy):
    a, b = smol_engine(smollm2), smol_engine(smollm2)
    first = prefill_and_hold(a, "x", PROMPT, FIRST_GREEDY)
    assert first == ref_greedy[:1]
    kv = export_and_release(a, "x")
    assert a.stats().num_cached_blocks == 2  # released blocks stay in A's prefix cache

    assert kv.token_ids == PROMPT + first and kv.num_prompt_tokens == len(PROMPT)
    assert kv.num_kv_tokens == len(PROMPT) and kv.start_block == 0
    assert kv.block_hashes == hash_prompt_blocks(PROMPT, BS, a.scope)
    assert kv.nbytes == 3 * block_bytes(smollm2.config)

    seq = b.import_kv(kv, greedy(N))  # max_tokens counts the token A sampled
    assert len(seq.block_table) == 3 and b.stats().num_free_blocks == b.stats().num_blocks - 3
    final = run_to_completion(b)["x"]
    assert final.token_ids == ref_greedy and final.finish_reason == "length"
    assert_idle(b)


def _decode_in_child(conn) -> None:  # runs in a spawned process
    try:
        from engine.loader import load_model

        kv, params = pickle.loads(conn.recv_bytes())
        b = smol_engine(load_model("smollm2"))
        conn.send(("ok", decode(b, kv, params)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def test_decode_in_a_spawned_process_continues_the_tokens_of_one_engine(smollm2, ref_greedy):
    a = smol_engine(smollm2)
    first = prefill_and_hold(a, "x", PROMPT, FIRST_GREEDY)
    kv = export_and_release(a, "x")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_in_child, args=(child,))
    proc.start()
    try:
        parent.send_bytes(pickle.dumps((kv, greedy(N))))  # plain pickle: what a network transport would carry
        assert parent.poll(180), "child process did not answer"
        status, payload = parent.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", payload
    assert first + payload[1:] == payload == ref_greedy


def test_only_missing_blocks_are_shipped_when_the_receiver_caches_the_prefix(smollm2, ref_long):
    b = smol_engine(smollm2)
    b.add_request("warm", SHARED, FIRST_GREEDY)
    run_to_completion(b)
    assert_idle(b)
    a = smol_engine(smollm2)
    prefill_and_hold(a, "long", LONG, FIRST_GREEDY)

    # the router's view: the one hash function over the prompt, asked of the receiver
    have = b.cached_prefix_blocks(hash_prompt_blocks(LONG, BS, a.scope), LONG)
    assert have == 16
    kv = export_and_release(a, "long", skip_blocks=have)
    assert kv.start_block == 16 and kv.num_blocks == 18
    assert kv.nbytes == (18 - 16) * block_bytes(smollm2.config)

    cached_ids = [b.block_manager.pool.lookup(h, SHARED[i * BS : (i + 1) * BS])
                  for i, h in enumerate(kv.block_hashes[:16])]
    seq = b.import_kv(kv, greedy(N))
    assert seq.block_table[:16] == cached_ids  # linked, not copied
    assert b.stats().num_free_blocks == b.stats().num_blocks - 18
    assert run_to_completion(b)["long"].token_ids == ref_long
    assert_idle(b)


def test_seeded_sampling_continues_identically_across_the_seam(smollm2, ref_greedy):
    alone = run_alone(smollm2, PROMPT, SamplingParams(max_tokens=N, ignore_eos=True, **SEEDED), num_blocks=64)
    assert alone != ref_greedy  # it really sampled
    a, b = smol_engine(smollm2), smol_engine(smollm2)
    first = prefill_and_hold(a, "s", PROMPT, SamplingParams(max_tokens=1, **SEEDED))
    kv = export_and_release(a, "s")
    tokens = decode(b, kv, SamplingParams(max_tokens=N, ignore_eos=True, **SEEDED))
    assert tokens[:1] == first and tokens == alone


def _retype(kv: KVExport, dtype: torch.dtype) -> KVExport:
    return dataclasses.replace(kv, k=[t.to(dtype) for t in kv.k], v=[t.to(dtype) for t in kv.v])


BAD_EXPORTS: dict[str, tuple[str, Callable[[KVExport], KVExport]]] = {
    "other_model": ("scope", lambda kv: dataclasses.replace(kv, scope=cache_scope("another-model", "float32"))),
    "block_size": ("block_size", lambda kv: dataclasses.replace(kv, block_size=32)),
    "layer_count": ("num_layers", lambda kv: dataclasses.replace(kv, k=kv.k[:-1], v=kv.v[:-1])),
    "dtype": ("dtype", lambda kv: _retype(kv, torch.bfloat16)),
    "k_shape": ("num_kv_heads", lambda kv: dataclasses.replace(kv, k=[t[:, :, :2] for t in kv.k])),
    "v_shape": ("v", lambda kv: dataclasses.replace(kv, v=[t[:-1] for t in kv.v])),
    "tokens_changed": ("block_hashes",
                       lambda kv: dataclasses.replace(kv, token_ids=[kv.token_ids[0] + 1, *kv.token_ids[1:]])),
    "forged_hashes": ("block_hashes", lambda kv: dataclasses.replace(
        kv, block_hashes=[BlockHash(bytes(32))] * len(kv.block_hashes))),
    "hash_count": ("block_hashes", lambda kv: dataclasses.replace(kv, block_hashes=kv.block_hashes[:1])),
    "token_out_of_vocab": ("token_ids", lambda kv: dataclasses.replace(kv, token_ids=[*kv.token_ids[:-1], 10**6])),
    "nothing_left_to_compute": ("num_kv_tokens", lambda kv: dataclasses.replace(kv, token_ids=kv.token_ids[:-1])),
}


@pytest.mark.parametrize("case", list(BAD_EXPORTS))
def test_invalid_export_is_rejected_before_any_write(smollm2, prompt_kv, ref_greedy, case):
    field, corrupt = BAD_EXPORTS[case]
    b = smol_engine(smollm2)
    before = b.stats()
    with pytest.raises(InvalidRequestError) as err:
        b.import_kv(corrupt(prompt_kv), greedy(N))
    assert err.value.field == field and field in str(err.value) and err.value.request_id == "x"
    assert b.stats() == before
    assert decode(b, prompt_kv, greedy(2)) == ref_greedy[:2]  # B is untouched and still works


def test_max_tokens_must_leave_something_to_decode(smollm2, prompt_kv):
    b = smol_engine(smollm2)
    with pytest.raises(InvalidRequestError) as err:
        b.import_kv(prompt_kv, greedy(1))  # the one token was sampled by the exporter already
    assert err.value.field == "max_tokens"
    assert_idle(b)


def test_importing_the_same_request_twice_is_rejected(smollm2, prompt_kv, ref_greedy):
    b = smol_engine(smollm2)
    b.import_kv(prompt_kv, greedy(3))
    after_first = b.stats()
    with pytest.raises(InvalidRequestError) as err:
        b.import_kv(prompt_kv, greedy(3))
    assert err.value.field == "request_id"
    assert b.stats() == after_first
    assert run_to_completion(b)["x"].token_ids == ref_greedy[:3]
    assert_idle(b)


def test_skipping_blocks_the_receiver_no_longer_caches_raises_capacity_error(smollm2, ref_long):
    b = smol_engine(smollm2, num_blocks=20)
    b.add_request("warm", SHARED, FIRST_GREEDY)  # 16 blocks cached; 4 never used
    run_to_completion(b)
    b.add_request("other", random_prompts(1, [70], seed=34)[0], FIRST_GREEDY)  # 5 blocks: evicts the prefix's tail
    run_to_completion(b)
    assert_idle(b)
    a = smol_engine(smollm2)
    prefill_and_hold(a, "long", LONG, FIRST_GREEDY)
    assert b.cached_prefix_blocks(hash_prompt_blocks(LONG, BS, a.scope), LONG) == 15

    before = b.stats()
    with pytest.raises(CapacityError) as err:
        b.import_kv(a.export_kv("long", skip_blocks=16), greedy(N))
    assert err.value.request_id == "long"
    assert b.stats() == before

    kv = export_and_release(a, "long", skip_blocks=15)  # the sender ships what the receiver lacks
    assert decode(b, kv, greedy(N)) == ref_long


# ---- the seam's bookkeeping, on the tiny model ---------------------------------------------------------------------
def test_export_or_release_of_an_unknown_request_raises(tiny):
    a = make_engine(tiny, num_blocks=16)
    with pytest.raises(KeyError, match="no KV held"):
        a.export_kv("missing")
    a.add_request("done", PROMPT, FIRST_GREEDY)  # finished without hold_kv: nothing is kept for it
    run_to_completion(a)
    with pytest.raises(KeyError, match="no KV held"):
        a.release_kv("done")
    assert_idle(a)


def test_abort_releases_a_held_request(tiny):
    a = make_engine(tiny, num_blocks=16)
    prefill_and_hold(a, "x", PROMPT, FIRST_GREEDY)
    a.abort_request("x")
    assert_idle(a)
    with pytest.raises(KeyError):
        a.export_kv("x")


def test_imported_request_survives_preemption_on_the_receiver(tiny):
    expected = run_alone(tiny, PROMPT, greedy(40))
    a = make_engine(tiny, num_blocks=16)
    prefill_and_hold(a, "x", PROMPT, FIRST_GREEDY)
    kv = export_and_release(a, "x")

    b = make_engine(tiny, num_blocks=8)  # 128 token slots for 3 sequences that grow to 60-85 tokens
    others = random_prompts(2, [20, 25], seed=35)
    for i, p in enumerate(others):
        b.add_request(f"o{i}", p, greedy(40))
    b.step()  # the others are admitted first, so the imported request is the newest: the first to be preempted
    seq = b.import_kv(kv, greedy(40))
    final = run_to_completion(b)
    assert seq.num_preemptions > 0
    assert final["x"].token_ids == expected
    assert [final[f"o{i}"].token_ids for i in range(2)] == [run_alone(tiny, p, greedy(40)) for p in others]
    assert_idle(b)


def test_receiver_streams_only_the_tokens_it_samples(tiny):
    alone = make_engine(tiny, num_blocks=16)
    alone.add_request("x", PROMPT, greedy(12))
    expected = run_to_completion(alone)["x"]

    a = make_engine(tiny, num_blocks=16)
    a.add_request("x", PROMPT, FIRST_GREEDY, hold_kv=True)
    first = run_to_completion(a)["x"]
    kv = export_and_release(a, "x")
    b = make_engine(tiny, num_blocks=16)
    b.import_kv(kv, greedy(12))
    outs = []
    while b.has_unfinished_requests():
        outs.extend(b.step())
    # what the user got from A, then from B, is the single-engine stream; B's final result covers it all
    assert first.token_ids + [t for o in outs for t in o.new_token_ids] == expected.token_ids == outs[-1].token_ids
    assert first.text + "".join(o.new_text for o in outs) == expected.text == outs[-1].text
    assert_idle(b)


@pytest.mark.parametrize(("max_model_len", "accepted"), [(46, False), (47, True)])
def test_export_must_leave_room_to_generate_within_the_receivers_context(tiny, max_model_len, accepted):
    a = make_engine(tiny, num_blocks=16)
    prefill_and_hold(a, "x", PROMPT, FIRST_GREEDY)
    kv = export_and_release(a, "x")  # 45 prompt tokens + 1 sampled
    b = make_engine(tiny, num_blocks=16, max_model_len=max_model_len)
    if accepted:
        out = decode(b, kv, greedy(N))
        assert out == run_alone(tiny, PROMPT, greedy(2))  # stops at max_model_len: 47 tokens in all
        return
    with pytest.raises(InvalidRequestError) as err:
        b.import_kv(kv, greedy(N))
    assert err.value.field == "token_ids"
    assert_idle(b)
