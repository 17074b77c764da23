"""int8 weights and int8 KV: the kernels, the KV seam (transfer round trip, layout check, prefix cache), quality."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import InvalidRequestError, SamplingParams
from engine.block_hash import hash_prompt_blocks
from engine.kv_quant import block_scales, gather_dequantized, write_quantized
from engine.linear import Int8Linear
from engine.quality import greedy_outputs, perplexity, top1_agreement
from kv_transfer import ReceiverEndpoint, TransferConfig, TransferState
from tests.helpers import (
    assert_idle,
    generate_ids,
    greedy,
    make_engine,
    open_kv_sender,
    prefill_layerwise,
    random_prompts,
)

INT8_KV = {"kv_cache_dtype": "int8"}
FIRST = SamplingParams(max_tokens=1, temperature=0)
PROMPT = random_prompts(1, [90], vocab=1000, seed=5)[0]


@pytest.fixture
def int8_endpoint(tiny):
    """A receiving endpoint over an engine with an int8 KV cache."""
    made: list[ReceiverEndpoint] = []

    def make(transport: str) -> ReceiverEndpoint:
        made.append(ReceiverEndpoint(make_engine(tiny, num_blocks=64, **INT8_KV), TransferConfig(transport=transport),
                                     local_name=f"int8-{transport}-{len(made)}"))
        return made[-1]

    yield make
    for ep in made:
        ep.close()


def test_int8_linear_is_close_to_the_float_matmul():
    g = torch.Generator().manual_seed(0)
    w, x, b = torch.randn(96, 64, generator=g), torch.randn(5, 64, generator=g), torch.randn(96, generator=g)
    lin = Int8Linear(w, b)
    assert lin.weight.dtype == torch.int8 and lin.weight.shape == (96, 64) and lin.scale.shape == (96,)
    assert (lin.dequantized() - w).abs().max() <= w.abs().amax() / 127  # at most one step of its row's scale
    y, want = lin(x), F.linear(x, w, b)
    assert y.dtype == torch.float32
    assert (y - want).norm() / want.norm() < 0.02


def test_int8_kv_blocks_store_tokens_and_scales_and_dequantize_close():
    bs, kvh, d = 4, 2, 8
    cache = torch.zeros(3, bs + 1, kvh, d, dtype=torch.int8)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, kvh, d, generator=g)
    write_quantized(cache, x[:3], torch.tensor([8, 9, 10]))  # block 2, slots 0..2
    write_quantized(cache, x[3:], torch.tensor([11, 4, 5]))  # block 2 slot 3, block 1 slots 0..1
    blocks = gather_dequantized(cache, torch.tensor([2, 1]), torch.float32)  # [2, bs, KVH, D]
    got = torch.cat([blocks[0], blocks[1, :2]])
    assert (got - x).abs().max() < 2 * x.abs().max() / 127
    assert (blocks[1, 2:] == 0).all()  # unwritten slots stay empty
    assert torch.allclose(block_scales(cache[2:3], bs)[0], x[:4].abs().amax(dim=(0, 2)) / 127)


@pytest.mark.parametrize("overrides", [{"quantization": "int8"}, INT8_KV, {"quantization": "int8", **INT8_KV}])
def test_quantized_engines_batch_like_they_run_alone_and_free_every_block(tiny, overrides):
    prompts = random_prompts(3, [9, 30, 47], vocab=1000, seed=2)
    e = make_engine(tiny, **overrides)
    batched = generate_ids(e, prompts, greedy(12))
    alone = [generate_ids(make_engine(tiny, **overrides), [p], greedy(12))[0] for p in prompts]
    assert batched == alone
    assert_idle(e)


def test_int8_kv_memory_is_about_a_quarter_of_float32(tiny):
    f32, i8 = make_engine(tiny), make_engine(tiny, **INT8_KV)
    assert i8.runner.kv.dtype == torch.int8
    ratio = i8.kv_layout.layer_nbytes(10) / f32.kv_layout.layer_nbytes(10)
    assert ratio == (16 + 1) / (16 * 4)  # one int8 per value + one scale row per block
    assert i8.scope != f32.scope and i8.kv_layout.dtype == "int8"


def test_prefix_caching_serves_int8_kv_blocks(tiny):
    prompt = random_prompts(1, [70], vocab=1000, seed=4)[0]
    e = make_engine(tiny, **INT8_KV)
    first = generate_ids(e, [prompt], greedy(8))
    again = generate_ids(e, [prompt], greedy(8), prefix="again")
    assert again == first and e.stats().cached_prompt_tokens == 64  # 4 full blocks of 16 from the cache


@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_int8_kv_transfer_round_trips_exactly_and_moves_only_missing_blocks(tiny, int8_endpoint, transport):
    ep = int8_endpoint(transport)
    b = ep.receiver.engine
    shared = random_prompts(1, [64], vocab=1000, seed=9)[0]
    for rid, prompt, cached in (("one", shared + PROMPT[:20], 0), ("two", shared + PROMPT[20:50], 4)):
        a = make_engine(tiny, num_blocks=64, **INT8_KV)
        sent: list[tuple[torch.Tensor, torch.Tensor]] = []
        sender = open_kv_sender(transport, ep.address, a, rid, prompt)

        def layers(layer: int, a=a, sender=sender, prompt=prompt, rid=rid, sent=sent) -> None:  # type: ignore[no-untyped-def]
            kv = a.read_kv_layer(rid, layer, sender.cached_blocks, num_tokens=len(prompt))
            sent.append(kv)
            sender.send_layer(layer, *kv)
        prefill_layerwise(a, sender, prompt, FIRST, layers=layers)
        assert sender.wait(10) is TransferState.DONE, sender.error
        assert sender.cached_blocks == cached
        assert sender.bytes_sent == b.kv_layout.num_layers * b.kv_layout.layer_nbytes(len(prompt) // 16 + 1 - cached)
        assert ep.receiver.wait(rid, 10) is TransferState.DONE
        ep.receiver.take(rid, greedy(4))
        with ep.receiver.engine_lock:
            for layer, (k, v) in enumerate(sent):
                k2, v2 = b.read_kv_layer(rid, layer, cached)
                assert torch.equal(k, k2) and torch.equal(v, v2)  # int8 values and scales, bit for bit
            b.abort_request(rid)


def test_a_receiver_refuses_kv_of_another_dtype(tiny):
    f32, i8 = make_engine(tiny), make_engine(tiny, **INT8_KV)
    prompt = random_prompts(1, [40], vocab=1000, seed=6)[0]
    hashes = hash_prompt_blocks(prompt, 16, f32.scope)
    with pytest.raises(InvalidRequestError) as e:
        i8.reserve_kv("r", f32.kv_layout, prompt, len(prompt), hashes)
    assert e.value.field == "scope"
    assert_idle(i8)


@pytest.mark.slow
def test_int8_quality_against_float32_on_smollm2(smollm2):
    """Teacher-forced top-1 agreement over 32 greedy tokens of varied prompts, and perplexity on a fixed text."""
    tok = smollm2.tokenizer
    msgs = ["What is the capital of Italy?", "Write a limerick about a cat.", "Explain how a rainbow forms.",
            "def is_prime(n):"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": m}])) for m in msgs]
    text = tok.encode("Bees are flying insects closely related to wasps and ants, known for their role in "
                      "pollination and for producing honey. There are over 20,000 known species of bees.")
    f32 = make_engine(smollm2)
    refs = greedy_outputs(f32, prompts, 32)
    ppl = perplexity(f32, text)
    for overrides in ({"quantization": "int8"}, {"quantization": "int8", **INT8_KV}):
        e = make_engine(smollm2, **overrides)
        assert top1_agreement(e, prompts, refs) >= 0.9, overrides
        assert perplexity(e, text) < ppl * 1.05, overrides
