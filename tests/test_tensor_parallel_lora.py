"""LoRA adapters on a TP group (engine/parallel/lora.py): each rank holds its share of every adapter, cut as the base
weights are (B's rows for q/k/v and gate/up, A's columns for o and down, whose partial deltas join the layer's
all-reduce), and the group's tokens equal one TP 1 engine's with the same adapters, in one batch mixing adapters and
the base model. Loading and unloading reach every rank (a slot freed and reused). CPU, gloo, float32, the tiny
random models of tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from engine import EngineConfig, LLMEngine
from engine.loader import tiny_model
from tests.helpers import greedy, random_prompts, run_to_completion
from tests.lora_adapters import make_adapter
from tests.test_tensor_parallel import LAYOUTS

TOKENS = 16


def lora_engine(loaded, tp: int) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_blocks=128, max_num_batched_tokens=256, num_threads=1, max_loras=2,
                                          max_lora_rank=8, tensor_parallel_size=tp))


def run(eng: LLMEngine, prompts: list[list[int]], names: list[str | None], tag: str) -> list[list[int]]:
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        eng.add_request(f"{tag}{i}", prompt, dataclasses.replace(greedy(TOKENS), lora=name))
    out = run_to_completion(eng)
    return [out[f"{tag}{i}"].token_ids for i in range(len(prompts))]


@pytest.mark.parametrize("layout,tp", [("gqa-8q-4kv", 2), ("tiny-4q-2kv", 4)], ids=["tp2", "tp4-kv-replicated"])
def test_adapters_on_a_tp_group_give_one_tp1_engines_tokens(tmp_path, layout: str, tp: int) -> None:
    loaded = tiny_model(**LAYOUTS[layout])
    paths = {"a": make_adapter(str(tmp_path / "a"), loaded, rank=8, seed=1),
             "b": make_adapter(str(tmp_path / "b"), loaded, rank=4, targets=("q_proj", "v_proj", "o_proj",
                                                                             "down_proj"), seed=2),
             "c": make_adapter(str(tmp_path / "c"), loaded, rank=8, targets=("k_proj", "gate_proj", "up_proj"),
                               seed=3)}
    prompts = random_prompts(6, [21, 9, 40, 14, 33, 5], vocab=loaded.config.vocab_size, seed=7)
    names = ["a", None, "b", "a", "b", None]
    results = {}
    for n in (1, tp):
        eng = lora_engine(loaded, n)
        try:
            for name in ("a", "b"):
                eng.load_lora(name, paths[name])
            first = run(eng, prompts, names, "x")
            eng.unload_lora("b")  # NOTE: its slot freed on every rank, then taken by "c"
            eng.load_lora("c", paths["c"])
            second = run(eng, prompts[:3], ["c", "a", None], "y")
        finally:
            eng.close()
        results[n] = (first, second)
    assert results[tp] == results[1]
    first, second = results[1]
    # NOTE: each adapter changes what the model says for the same prompt (a, b, then c in b's freed slot)
    assert first[0] != run_base(loaded, prompts[0]) and first[2] != run_base(loaded, prompts[2])
    assert second[0] != run_base(loaded, prompts[0])


def run_base(loaded, prompt: list[int]) -> list[int]:
    eng = LLMEngine(loaded, EngineConfig(num_blocks=64, num_threads=1))
    return run(eng, [prompt], [None], "base")[0]
