"""Multi-LoRA in the engine (engine/lora/): an adapter's greedy tokens are the merged model's, a batch mixing the base
and three adapters gives each request its tokens alone, the prefix cache never crosses adapters, bad adapters are
refused naming what is wrong while the engine serves on. Adapters are made here (tests/lora_adapters.py).

Tolerance: none; tokens are compared exactly. The tiny model's logits are far apart, so the float32 rounding between
a merged weight and the unmerged delta (another order of the same sums) never flips a greedy choice.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from engine import EngineConfig, InvalidRequestError, LLMEngine
from engine.lora import LoRALoadError
from tests.helpers import generate_ids, greedy, make_engine, random_prompts
from tests.lora_adapters import ALL_TARGETS, make_adapter, merged_model, module_shape, rewrite

PROMPTS = random_prompts(8, [5, 17, 33, 9], vocab=49152, seed=3)
TOKENS = 12


def lora_engine(loaded, **overrides) -> LLMEngine:
    return make_engine(loaded, **({"max_loras": 4, "max_lora_rank": 16} | overrides))


def with_lora(name: str | None, n: int = TOKENS):
    return dataclasses.replace(greedy(n), lora=name)


@pytest.mark.parametrize("rank,targets,key_style", [
    (8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), "peft"),
    (16, ("q_proj", "v_proj"), "default"),
    (4, ("k_proj", "up_proj", "down_proj"), "peft"),
])
def test_adapter_tokens_equal_the_merged_model(tiny, tmp_path, rank, targets, key_style) -> None:
    path = make_adapter(str(tmp_path / "a"), tiny, rank=rank, targets=targets, key_style=key_style, seed=rank)
    engine = lora_engine(tiny)
    engine.load_lora("a", path)
    ours = generate_ids(engine, PROMPTS, with_lora("a"))
    reference = generate_ids(make_engine(merged_model(tiny, path)), PROMPTS, greedy(TOKENS))
    assert ours == reference
    base = generate_ids(make_engine(tiny), PROMPTS, greedy(TOKENS))
    assert sum(o != b for o, b in zip(ours, base)) >= 4  # the adapter changes what the model says


def test_one_batch_of_the_base_and_three_adapters_gives_each_request_its_tokens_alone(tiny, tmp_path) -> None:
    paths = {f"a{i}": make_adapter(str(tmp_path / f"a{i}"), tiny, rank=r, seed=10 + i)
             for i, r in enumerate((4, 8, 16))}
    engine = lora_engine(tiny)
    for name, path in paths.items():
        engine.load_lora(name, path)
    # NOTE: adapters interleaved (a request's neighbours run other adapters: the gather path) and each prompt asked
    # under two adapters, so equal prompts must not share blocks or rows
    names = [None, "a0", "a1", "a2", "a2", "a1", None, "a0"]
    for i, (prompt, name) in enumerate(zip(PROMPTS, names)):
        engine.add_request(f"r{i}", prompt, with_lora(name))
        engine.add_request(f"s{i}", prompt, with_lora(names[(i + 1) % 8]))
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.token_ids
    alone = lora_engine(tiny, enable_prefix_caching=False)
    for name, path in paths.items():
        alone.load_lora(name, path)
    for i, (prompt, name) in enumerate(zip(PROMPTS, names)):
        for rid, nm in ((f"r{i}", name), (f"s{i}", names[(i + 1) % 8])):
            assert outs[rid] == generate_ids(alone, [prompt], with_lora(nm), prefix=f"alone-{rid}")[0], rid
    assert len({tuple(outs[f"r{i}"]) for i in range(1, 4)}) == 3  # three adapters, three different answers


def test_a_prefix_cached_under_one_adapter_is_never_served_to_another(tiny, tmp_path) -> None:
    engine = lora_engine(tiny)
    for name in ("x", "y"):
        engine.load_lora(name, make_adapter(str(tmp_path / name), tiny, seed=ord(name)))
    prompt = random_prompts(1, [3 * 16 + 5], seed=9)[0]  # three full blocks

    def cached(rid: str, name: str | None) -> tuple[int, list[int]]:
        seq = engine.add_request(rid, prompt, with_lora(name, 4))
        while engine.has_unfinished_requests():
            engine.step()
        return seq.num_cached_tokens, seq.output_token_ids

    first_x, tokens_x = cached("x1", "x")
    assert first_x == 0
    assert cached("base", None)[0] == 0  # x's blocks are not the base model's
    hit, tokens_y = cached("y1", "y")
    assert hit == 0  # nor y's
    assert cached("x2", "x") == (48, tokens_x)  # x's own request hits all three blocks and says the same
    assert cached("y2", "y") == (48, tokens_y)
    assert tokens_x != tokens_y


def test_reloading_a_name_with_other_weights_does_not_hit_the_old_blocks(tiny, tmp_path) -> None:
    engine = lora_engine(tiny)
    prompt = random_prompts(1, [2 * 16 + 1], seed=4)[0]
    engine.load_lora("x", make_adapter(str(tmp_path / "x1"), tiny, seed=1))
    generate_ids(engine, [prompt], with_lora("x", 2), prefix="one")
    engine.unload_lora("x")
    engine.load_lora("x", make_adapter(str(tmp_path / "x2"), tiny, seed=2))
    seq = engine.add_request("two", prompt, with_lora("x", 2))
    engine.step()
    assert seq.num_cached_tokens == 0


def _bad(kind: str, tiny, path: str) -> str:
    """Write the bad adapter `kind` at `path`; the words its refusal must hold."""
    if kind == "missing weights":
        make_adapter(path, tiny)
        os.remove(os.path.join(path, "adapter_model.safetensors"))
        return "missing file adapter_model.safetensors"
    if kind == "missing config":
        make_adapter(path, tiny)
        os.remove(os.path.join(path, "adapter_config.json"))
        return "missing file adapter_config.json"
    if kind == "rank too large":
        make_adapter(path, tiny, rank=32)
        return "rank 32 exceeds max_lora_rank 16"
    if kind == "wrong shape":
        make_adapter(path, tiny)
        out, _ = module_shape(tiny, "q_proj")
        rewrite(path, replace={"base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight": torch.zeros(8, 7)})
        return f"layers.1.q_proj: wrong shapes lora_A [8, 7], lora_B [{out}, 8]"
    if kind == "unknown target (config)":
        make_adapter(path, tiny, targets=("q_proj",), config_extra={"target_modules": ["q_proj", "embed_tokens"]})
        return "unknown target module(s) ['embed_tokens']"
    if kind == "unknown target (weights)":
        make_adapter(path, tiny, targets=("q_proj",), config_extra={"target_modules": "all-linear"})
        rewrite(path, replace={"base_model.model.model.layers.0.mlp.fc1.lora_A.weight": torch.zeros(8, 64)})
        return "unknown target module 'fc1'"
    if kind == "lora_B missing":
        make_adapter(path, tiny, targets=("v_proj",))
        rewrite(path, drop="layers.0.self_attn.v_proj.lora_B")
        return "layers.0.v_proj has lora_B missing"
    if kind == "layer out of range":
        make_adapter(path, tiny, targets=("q_proj",), layers=[0, 5])
        return "layer 5 but the model has 2 layers"
    if kind == "dora":
        make_adapter(path, tiny, config_extra={"use_dora": True})
        return "use_dora is not supported"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing weights", "missing config", "rank too large", "wrong shape",
                                  "unknown target (config)", "unknown target (weights)", "lora_B missing",
                                  "layer out of range", "dora"])
def test_a_bad_adapter_is_refused_naming_the_problem_and_the_engine_serves_on(tiny, tmp_path, kind) -> None:
    engine = lora_engine(tiny, max_loras=1)
    good = make_adapter(str(tmp_path / "good"), tiny, seed=5)
    words = _bad(kind, tiny, str(tmp_path / "bad"))
    with pytest.raises(LoRALoadError) as e:
        engine.load_lora("bad", str(tmp_path / "bad"))
    assert words in str(e.value) and "'bad'" in str(e.value) and e.value.field == "lora"
    assert engine.lora_names() == []
    engine.load_lora("good", good)  # the refused adapter took no slot (max_loras is 1)
    assert generate_ids(engine, PROMPTS[:2], with_lora("good")) == generate_ids(
        make_engine(merged_model(tiny, good)), PROMPTS[:2], greedy(TOKENS))


def test_requests_and_slots_are_checked(tiny, tmp_path) -> None:
    engine = lora_engine(tiny, max_loras=1)
    with pytest.raises(InvalidRequestError, match="lora: no adapter named 'nope' is loaded"):
        engine.add_request("r", PROMPTS[0], with_lora("nope"))
    engine.load_lora("a", make_adapter(str(tmp_path / "a"), tiny))
    with pytest.raises(LoRALoadError, match="max_loras: all 1 adapter slots are taken"):
        engine.load_lora("b", make_adapter(str(tmp_path / "b"), tiny))
    with pytest.raises(LoRALoadError, match="already loaded"):
        engine.load_lora("a", str(tmp_path / "a"))
    engine.add_request("r", PROMPTS[0], with_lora("a"))
    with pytest.raises(InvalidRequestError, match="in use by 1 request"):
        engine.unload_lora("a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_lora("a")
    assert engine.lora_names() == []
    off = make_engine(tiny)
    with pytest.raises(InvalidRequestError, match="serves no adapters"):
        off.add_request("r", PROMPTS[0], with_lora("a"))
    with pytest.raises(InvalidRequestError, match="max_loras"):
        off.load_lora("a", str(tmp_path / "a"))
    with pytest.raises(InvalidRequestError, match="max_loras"):
        EngineConfig(max_loras=-1)


@pytest.mark.parametrize("names,counts,path", [
    (["a", "a", "b", "b", "c", "c", None], [1] * 7, "span"),  # a decode batch sorted by LoRASlots.order: a slice
    (["a", "b", "c", "a", "b", "c", None, "a"], [1] * 8, "batched"),  # unsorted: bmm over gathered rows and slots
    (["a", "b", None, "b", "a", "c", "c", "a"], [1] * 8, "batched"),  # uneven segments: padded rows masked
    (["c", "a", None, "c", "b"], [30, 1, 1, 1, 1], "loop"),  # a prefill beside decodes: a matmul pair each
    (["b", None], [5, 7], "slices"),  # one adapter, its rows together: slices of x and y, no gather
])
@pytest.mark.parametrize("linear", ["down", "qkv", "gate_up"])  # NOTE: q/k/v and gate/up: B.T in output chunks
def test_every_cpu_path_adds_each_row_s_own_delta(tiny, tmp_path, names, counts, path, linear) -> None:
    from engine.lora.adapter import part_sizes

    engine = lora_engine(tiny)
    # NOTE: "b" leaves out q and gate (the first part of a fused linear) and "c" k/o/up: each chunk is its own part's
    some = {"b": ("k_proj", "v_proj", "o_proj", "up_proj", "down_proj"), "c": ("q_proj", "v_proj", "gate_proj")}
    for i, name in enumerate("abc"):
        engine.load_lora(name, make_adapter(str(tmp_path / name), tiny, rank=4 * (i + 1), seed=20 + i,
                                            targets=some.get(name, ALL_TARGETS)))
    slots = engine.lora
    assert slots is not None
    g = torch.Generator().manual_seed(1)
    t = sum(counts)
    parts = part_sizes(tiny.config)[linear]
    x = torch.randn(t, parts[0][1], generator=g)  # [T, in]
    y = torch.randn(t, sum(out for out, _ in parts), generator=g)  # [T, out]
    want = y.clone()
    row = 0
    for name, n in zip(names, counts):
        if name is not None:
            pair = slots.get(name).layers[1].get(linear)
            if pair is not None:
                want[row:row + n] += x[row:row + n] @ pair.a.T @ pair.b.T
        row += n
    slots.begin(names, counts)
    step = slots.step
    assert step is not None
    assert path == ("span" if step.span else "batched" if step.batched is not None else
                    "slices" if step.contiguous else "loop")
    step.add_delta(x, y, 1, linear)
    slots.end()
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5)


def test_an_adapter_request_moves_between_engines_through_the_kv_seam(tiny, tmp_path) -> None:
    """Prefill on engine A with adapter x, its KV into engine B (which loaded the same x) through the KV seam, decode
    on B: the tokens of x alone. B refuses the KV under another adapter (the hashes carry the adapter's key) and a
    commit whose params name another adapter."""
    from engine.block_hash import hash_prompt_blocks

    path = make_adapter(str(tmp_path / "x"), tiny, seed=41)
    other = make_adapter(str(tmp_path / "y"), tiny, seed=42)
    a, b = lora_engine(tiny), lora_engine(tiny)
    a.load_lora("x", path)
    b.load_lora("x", path)
    b.load_lora("y", other)
    prompt = random_prompts(1, [2 * 16 + 7], seed=43)[0]
    a.add_request("r", prompt, with_lora("x", 2))
    first = next(o for o in a.step() if o.request_id == "r").new_token_ids
    layers = [a.read_kv_layer("r", i, num_tokens=len(prompt)) for i in range(tiny.config.num_layers)]
    a.abort_request("r")  # NOTE: as a prefill worker releases a request once its KV left
    assert a.lora is not None
    hashes = hash_prompt_blocks(prompt, 16, a.scope, extra_keys=a.lora.get("x").key)
    with pytest.raises(InvalidRequestError, match="block_hashes: do not match"):
        b.reserve_kv("r", b.kv_layout, prompt, len(prompt), hashes, lora="y")
    with pytest.raises(InvalidRequestError, match="block_hashes: do not match"):
        b.reserve_kv("r", b.kv_layout, prompt, len(prompt), hashes)  # nor as the base model's
    res = b.reserve_kv("r", b.kv_layout, prompt, len(prompt), hashes, lora="x")
    for i, (k, v) in enumerate(layers):
        b.write_kv_blocks(res, i, 0, 0, k)
        b.write_kv_blocks(res, i, 1, 0, v)
    with pytest.raises(InvalidRequestError, match="lora: 'y' is not the adapter the KV was reserved for"):
        b.commit_kv("r", first, with_lora("y"))
    res = b.reserve_kv("r", b.kv_layout, prompt, len(prompt), hashes, lora="x")
    for i, (k, v) in enumerate(layers):
        b.write_kv_blocks(res, i, 0, 0, k)
        b.write_kv_blocks(res, i, 1, 0, v)
    b.commit_kv("r", first, with_lora("x"))
    while b.has_unfinished_requests():
        for out in b.step():
            if out.finished:
                moved = out.token_ids
    ref = lora_engine(tiny)
    ref.load_lora("x", path)
    assert moved == generate_ids(ref, [prompt], with_lora("x"))[0]
