"""The KV seam on the real SmolLM2 weights: prefill in engine A, KV sent layer by layer into engine B, decode on.

Everything goes the way the pools do it: A's prefill hands each layer to a `local` sender from inside the forward
pass and commits the first token, B's `ReceiverEndpoint` reserves, checks and writes, and B `take`s the transfer.
A request split across two engines must give exactly the tokens of one engine alone; a transfer's description
is checked in full before B writes a byte, and B links the blocks it already caches. (The same across two
processes, over grpc and torch: test_kv_transfer_processes.py.)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import pytest
import torch

from engine import CapacityError, InvalidRequestError, LLMEngine, SamplingParams
from engine.block_hash import cache_scope, hash_prompt_blocks
from engine.config import ModelConfig
from engine.loader import LoadedModel
from kv_transfer import ReceiverEndpoint, TransferConfig, TransferError, TransferState, payload
from kv_transfer.messages import PrepareRequest
from tests.helpers import (
    assert_idle,
    describe,
    greedy,
    layer_sender,
    make_engine,
    open_kv_sender,
    prefill_layerwise,
    random_prompts,
    run_alone,
    run_to_completion,
)

BS = 16
N = 8
PROMPT = random_prompts(1, [45], seed=31)[0]  # 2 full blocks + 13 tokens
SHARED = random_prompts(1, [256], seed=32)[0]  # 16 full blocks
LONG = SHARED + random_prompts(1, [19], seed=33)[0]  # 275 tokens: 18 blocks
FIRST_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)
SEEDED = {"temperature": 0.8, "seed": 7}
_names = itertools.count()


def smol_engine(loaded: LoadedModel, **overrides: object) -> LLMEngine:
    return make_engine(loaded, **{"num_blocks": 64, **overrides})


def block_bytes(cfg: ModelConfig) -> int:
    """K and V of one fp32 block in every layer, from the model's shape."""
    return 2 * cfg.num_layers * BS * cfg.num_kv_heads * cfg.head_dim * 4


@pytest.fixture
def receiver():
    """`receiver(loaded, **engine overrides)`: a fresh engine B behind a local ReceiverEndpoint (closed after)."""
    made: list[ReceiverEndpoint] = []

    def make(loaded: LoadedModel, **overrides: object) -> ReceiverEndpoint:
        ep = ReceiverEndpoint(smol_engine(loaded, **overrides), TransferConfig(transport="local"),
                              local_name=f"kv-seam-{next(_names)}")
        made.append(ep)
        return ep

    yield make
    for ep in made:
        ep.close()


def send(a: LLMEngine, ep: ReceiverEndpoint, request_id: str, prompt: list[int],
         first: SamplingParams = FIRST_GREEDY) -> tuple[object, list[int]]:
    """Prefill on A sending each layer to B as it is computed; A is back at baseline, the transfer DONE."""
    sender = open_kv_sender("local", ep.address, a, request_id, prompt)
    tokens = prefill_layerwise(a, sender, prompt, first)
    assert sender.wait(10) is TransferState.DONE, sender.error
    assert_idle(a)
    return sender, tokens


def decode(ep: ReceiverEndpoint, request_id: str, params: SamplingParams) -> list[int]:
    ep.receiver.take(request_id, params)
    tokens = run_to_completion(ep.receiver.engine)[request_id].token_ids
    assert_idle(ep.receiver.engine)
    return tokens


@pytest.fixture(scope="module")
def ref_greedy(smollm2) -> list[int]:
    return run_alone(smollm2, PROMPT, greedy(N), num_blocks=64)


@pytest.fixture(scope="module")
def ref_long(smollm2) -> list[int]:
    return run_alone(smollm2, LONG, greedy(N), num_blocks=64)


def test_decode_on_another_engine_continues_the_tokens_of_one_engine(smollm2, receiver, ref_greedy):
    a, ep = smol_engine(smollm2), receiver(smollm2)
    b = ep.receiver.engine
    sender, first = send(a, ep, "x", PROMPT)
    assert first == ref_greedy[:1]
    assert a.stats().num_cached_blocks == 2  # released blocks stay in A's prefix cache

    assert sender.token_ids == PROMPT and sender.num_prompt_tokens == len(PROMPT)
    assert list(sender.block_hashes) == hash_prompt_blocks(PROMPT, BS, a.scope)
    assert (sender.cached_blocks, sender.num_blocks) == (0, 3)
    assert sender.bytes_sent == 3 * block_bytes(smollm2.config)

    seq = ep.receiver.take("x", greedy(N))  # max_tokens counts the token A sampled
    assert len(seq.block_table) == 3 and b.stats().num_free_blocks == b.stats().num_blocks - 3
    final = run_to_completion(b)["x"]
    assert final.token_ids == ref_greedy and final.finish_reason == "length"
    assert_idle(b)


def test_only_missing_blocks_are_shipped_when_the_receiver_caches_the_prefix(smollm2, receiver, ref_long):
    ep = receiver(smollm2)
    b = ep.receiver.engine
    b.add_request("warm", SHARED, FIRST_GREEDY)
    run_to_completion(b)
    assert_idle(b)
    cached_ids = [b.block_manager.pool.lookup(h, SHARED[i * BS : (i + 1) * BS])
                  for i, h in enumerate(hash_prompt_blocks(SHARED, BS, b.scope))]

    sender, _ = send(smol_engine(smollm2), ep, "long", LONG)
    assert (sender.cached_blocks, sender.num_blocks) == (16, 2)  # the receiver said what it lacks
    assert sender.bytes_sent == (18 - 16) * block_bytes(smollm2.config)

    seq = ep.receiver.take("long", greedy(N))
    assert seq.block_table[:16] == cached_ids  # linked, not copied
    assert b.stats().num_free_blocks == b.stats().num_blocks - 18
    assert run_to_completion(b)["long"].token_ids == ref_long
    assert_idle(b)


def test_seeded_sampling_continues_identically_across_the_seam(smollm2, receiver, ref_greedy):
    alone = run_alone(smollm2, PROMPT, SamplingParams(max_tokens=N, ignore_eos=True, **SEEDED), num_blocks=64)
    assert alone != ref_greedy  # it really sampled
    ep = receiver(smollm2)
    _, first = send(smol_engine(smollm2), ep, "s", PROMPT, SamplingParams(max_tokens=1, **SEEDED))
    tokens = decode(ep, "s", SamplingParams(max_tokens=N, ignore_eos=True, **SEEDED))
    assert tokens[:1] == first and tokens == alone


def _layout(**change: object) -> Callable[[PrepareRequest], PrepareRequest]:
    return lambda req: dataclasses.replace(req, layout=dataclasses.replace(req.layout, **change))


BAD_DESCRIPTIONS: dict[str, tuple[str, Callable[[PrepareRequest], PrepareRequest]]] = {
    "other_model": ("scope", _layout(scope=cache_scope("another-model", "float32"))),
    "block_size": ("block_size", _layout(block_size=32)),
    "layer_count": ("num_layers", _layout(num_layers=29)),
    "dtype": ("dtype", _layout(dtype="bfloat16")),
    "kv_heads": ("num_kv_heads", _layout(num_kv_heads=2)),
    "tokens_changed": ("block_hashes", lambda req: dataclasses.replace(
        req, token_ids=[req.token_ids[0] + 1, *req.token_ids[1:]])),
    "forged_hashes": ("block_hashes", lambda req: dataclasses.replace(req, block_hashes=[bytes(32)] * 2)),
    "hash_count": ("block_hashes", lambda req: dataclasses.replace(req, block_hashes=req.block_hashes[:1])),
    "token_out_of_vocab": ("token_ids", lambda req: dataclasses.replace(req, token_ids=[*req.token_ids[:-1], 10**6])),
    "prompt_length": ("num_prompt_tokens", lambda req: dataclasses.replace(req, num_prompt_tokens=0)),
}
BAD_DATA: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {
    "k_shape": ("data", lambda k: k[:, :, :2].contiguous()),
    "k_dtype": ("data", lambda k: k.to(torch.bfloat16)),
    "too_many_blocks": ("first_block", lambda k: torch.cat([k, k[:1]])),
}


@pytest.mark.parametrize("case", list(BAD_DESCRIPTIONS) + list(BAD_DATA))
def test_an_invalid_transfer_is_rejected_before_any_write(smollm2, receiver, ref_greedy, case):
    ep = receiver(smollm2)
    b = ep.receiver.engine
    before = b.stats()
    with pytest.raises(InvalidRequestError) as err:
        if case in BAD_DESCRIPTIONS:
            ep.receiver.prepare(BAD_DESCRIPTIONS[case][1](describe(b, "x", PROMPT)))
        else:
            prepared = ep.receiver.prepare(describe(b, "x", PROMPT))
            k = BAD_DATA[case][1](torch.zeros(prepared.num_blocks, *b.kv_layout.block_shape))
            ep.receiver.on_tensor(payload.seal(prepared.transfer_id, 0, 0, 0, k), k)
    field = (BAD_DESCRIPTIONS | BAD_DATA)[case][0]
    assert err.value.field == field and field in str(err.value) and err.value.request_id == "x"
    assert b.stats() == before and ep.receiver.num_inflight == 0
    send(smol_engine(smollm2), ep, "x", PROMPT)  # B is untouched and still works
    assert decode(ep, "x", greedy(2)) == ref_greedy[:2]


@pytest.mark.parametrize(("field", "max_tokens", "commit_tokens"), [("max_tokens", 1, True),
                                                                    ("next_token_ids", N, False)])
def test_the_commit_must_leave_something_to_decode(smollm2, receiver, field, max_tokens, commit_tokens):
    a, ep = smol_engine(smollm2), receiver(smollm2)
    sender = open_kv_sender("local", ep.address, a, "x", PROMPT)
    if not commit_tokens:
        commit = sender.commit
        sender.commit = lambda token_ids, num_cached=0: commit([], num_cached)
    prefill_layerwise(a, sender, PROMPT, FIRST_GREEDY)
    assert sender.wait(10) is TransferState.DONE, sender.error
    with pytest.raises(InvalidRequestError) as err:
        ep.receiver.take("x", greedy(max_tokens))  # max_tokens=1: the one token was sampled by A already
    assert err.value.field == field
    assert_idle(ep.receiver.engine)


def test_a_second_transfer_of_a_running_request_is_rejected(smollm2, receiver, ref_greedy):
    ep = receiver(smollm2)
    b = ep.receiver.engine
    send(smol_engine(smollm2), ep, "x", PROMPT)
    ep.receiver.take("x", greedy(3))
    after_first = b.stats()
    with pytest.raises(InvalidRequestError) as err:
        ep.receiver.prepare(describe(b, "x", PROMPT))
    assert err.value.field == "request_id"
    assert b.stats() == after_first
    assert run_to_completion(b)["x"].token_ids == ref_greedy[:3]
    assert_idle(b)


def test_the_sender_ships_what_the_receiver_still_caches_after_an_eviction(smollm2, receiver, ref_long):
    ep = receiver(smollm2, num_blocks=20)
    b = ep.receiver.engine
    b.add_request("warm", SHARED, FIRST_GREEDY)  # 16 blocks cached; 4 never used
    run_to_completion(b)
    b.add_request("other", random_prompts(1, [70], seed=34)[0], FIRST_GREEDY)  # 5 blocks: evicts the prefix's tail
    run_to_completion(b)
    assert_idle(b)
    sender, _ = send(smol_engine(smollm2), ep, "long", LONG)
    assert (sender.cached_blocks, sender.num_blocks) == (15, 3)
    assert decode(ep, "long", greedy(N)) == ref_long


# ---- the seam's bookkeeping, on the tiny model ---------------------------------------------------------------------
def test_a_full_receiver_refuses_with_a_retryable_capacity_error(tiny, receiver):
    ep = receiver(tiny, num_blocks=8)
    b = ep.receiver.engine
    b.add_request("busy", random_prompts(1, [90], vocab=1000, seed=36)[0], greedy(4))
    b.step()  # 6 of 8 blocks in use
    before = b.stats()
    with pytest.raises(CapacityError) as err:
        ep.receiver.prepare(describe(b, "x", PROMPT))
    assert err.value.request_id == "x" and "2 free" in err.value.reason
    sender = open_kv_sender("local", ep.address, make_engine(tiny, num_blocks=16), "x", PROMPT)
    with pytest.raises(TransferError) as failed:
        sender.prepare()
    assert failed.value.retryable  # the sender's view: blocks may free up
    assert b.stats() == before


def test_kv_of_an_unknown_or_finished_request_is_not_there(tiny, receiver):
    a = make_engine(tiny, num_blocks=16)
    with pytest.raises(KeyError, match="no KV held"):
        a.read_kv_layer("missing", 0)
    with pytest.raises(KeyError, match="not a running request"):
        a.watch_layers("missing", lambda layer: None)
    a.add_request("done", PROMPT, FIRST_GREEDY)  # finished: nothing is kept for it
    run_to_completion(a)
    with pytest.raises(KeyError, match="no KV held"):
        a.read_kv_layer("done", 0)
    with pytest.raises(TransferError, match="no completed transfer"):
        receiver(tiny).receiver.take("missing", greedy(N))
    assert_idle(a)


def test_an_abort_during_the_prefill_frees_both_sides(tiny, receiver):
    a, ep = make_engine(tiny, num_blocks=16), receiver(tiny, num_blocks=16)
    sender = open_kv_sender("local", ep.address, a, "x", PROMPT)
    sender.prepare()
    a.add_request("x", PROMPT, FIRST_GREEDY)
    a.watch_layers("x", layer_sender(a, sender, PROMPT))
    assert ep.receiver.engine.stats().num_reserved == 1
    a.abort_request("x")  # what the prefill worker does on an abort: the engine, then the sender
    sender.abort("client went away")
    assert sender.state is TransferState.FAILED and "client went away" in ep.receiver.error("x").reason
    assert_idle(a)
    assert_idle(ep.receiver.engine)


def test_a_transferred_request_survives_preemption_on_the_receiver(tiny, receiver):
    expected = run_alone(tiny, PROMPT, greedy(40))
    ep = receiver(tiny, num_blocks=8)  # 128 token slots for 3 sequences that grow to 60-85 tokens
    b = ep.receiver.engine
    others = random_prompts(2, [20, 25], seed=35)
    for i, p in enumerate(others):
        b.add_request(f"o{i}", p, greedy(40))
    b.step()  # the others are admitted first, so the transferred request is the newest: the first to be preempted
    send(make_engine(tiny, num_blocks=16), ep, "x", PROMPT)
    seq = ep.receiver.take("x", greedy(40))
    final = run_to_completion(b)
    assert seq.num_preemptions > 0
    assert final["x"].token_ids == expected
    assert [final[f"o{i}"].token_ids for i in range(2)] == [run_alone(tiny, p, greedy(40)) for p in others]
    assert_idle(b)


def test_the_receiver_streams_only_the_tokens_it_samples(tiny, receiver):
    alone = make_engine(tiny, num_blocks=16)
    alone.add_request("x", PROMPT, greedy(12))
    expected = run_to_completion(alone)["x"]

    a, ep = make_engine(tiny, num_blocks=16), receiver(tiny, num_blocks=16)
    sender = open_kv_sender("local", ep.address, a, "x", PROMPT)
    sender.prepare()
    a.add_request("x", PROMPT, greedy(12))  # the user's params: A stops after the first token (released)
    a.watch_layers("x", layer_sender(a, sender, PROMPT))
    first = a.step()[0]
    sender.commit(first.new_token_ids, first.num_cached_tokens)
    a.abort_request("x")
    assert sender.wait(10) is TransferState.DONE, sender.error
    b = ep.receiver.engine
    ep.receiver.take("x", greedy(12))
    outs = []
    while b.has_unfinished_requests():
        outs.extend(b.step())
    # what the user got from A, then from B, is the single-engine stream; B's final result covers it all
    assert first.token_ids + [t for o in outs for t in o.new_token_ids] == expected.token_ids == outs[-1].token_ids
    assert first.text + "".join(o.new_text for o in outs) == expected.text == outs[-1].text
    assert_idle(a)
    assert_idle(b)


@pytest.mark.parametrize(("max_model_len", "accepted"), [(46, False), (47, True)])
def test_the_kv_must_leave_room_to_generate_within_the_receivers_context(tiny, receiver, max_model_len, accepted):
    ep = receiver(tiny, num_blocks=16, max_model_len=max_model_len)  # 45 prompt tokens + 1 sampled
    a = make_engine(tiny, num_blocks=16)
    if accepted:
        send(a, ep, "x", PROMPT)
        assert decode(ep, "x", greedy(N)) == run_alone(tiny, PROMPT, greedy(2))  # stops at 47 tokens in all
        return
    sender = open_kv_sender("local", ep.address, a, "x", PROMPT)
    with pytest.raises(TransferError, match="token_ids: 45 KV tokens") as err:
        sender.prepare()
    assert not err.value.retryable
    assert_idle(ep.receiver.engine)
