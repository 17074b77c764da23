"""Token-exact greedy agreement with Hugging Face transformers on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from engine.config import RopeScaling
from engine.loader import LoadedModel, load_model, save_hf_dir, tiny_model
from tests.helpers import generate_ids, hf_greedy, hf_model_from, make_engine

N_TOKENS = 32
NEAR_TIE = 1e-3

LONG_TEXT = " ".join(
    f"Section {i}: the committee reviewed item {i * 7 % 13} of the harbour budget, noting that ferry repairs, "
    f"pier lighting and {['tide gauges', 'crane leases', 'dredging'][i % 3]} would cost about {100 + 17 * i} "
    f"thousand euros, and asked the port office to report back before the {i + 2}th meeting."
    for i in range(14)
)


def varied_prompts(loaded: LoadedModel) -> list[list[int]]:
    """Ten prompts: short, long (> 600 tokens), chat-templated, code, digits, non-English; lengths differ."""
    tok = loaded.tokenizer
    texts = [
        "The capital of France is",
        "Hi",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "1, 1, 2, 3, 5, 8, 13,",
        "La tour Eiffel est située à",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        LONG_TEXT + "\nSummary of the meeting:",
    ]
    chats = [
        [{"role": "user", "content": "What is the boiling point of water at sea level?"}],
        [{"role": "system", "content": "You answer in one short sentence."},
         {"role": "user", "content": "Name three primary colors."}],
        [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    ]
    prompts = [tok.encode(t) for t in texts] + [tok.encode(tok.apply_chat_template(c)) for c in chats]
    assert max(len(p) for p in prompts) > 600 and len({len(p) for p in prompts}) == 10
    return prompts


def check_against_reference(ours: list[list[int]], hf_model: torch.nn.Module, prompts: list[list[int]]) -> None:
    """At least 9 of 10 equal; any divergence happens where transformers' top-2 logits nearly tie."""
    exact = 0
    for prompt, mine in zip(prompts, ours):
        ref, logits = hf_greedy(hf_model, prompt, N_TOKENS)
        if mine[: len(ref)] == ref:
            exact += 1
            continue
        j = next(i for i, (a, b) in enumerate(zip(mine, ref)) if a != b)
        top2 = torch.topk(logits[j], 2).values
        gap = float(top2[0] - top2[1])
        assert gap < NEAR_TIE, f"diverged at token {j} with top-2 gap {gap:.2e}: ours {mine} vs ref {ref}"
    assert exact >= 9, f"only {exact}/10 prompts matched exactly"


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2: LoadedModel, hf_smollm2: torch.nn.Module) -> None:
    prompts = varied_prompts(smollm2)
    engine = make_engine(smollm2, num_blocks=1024, max_num_batched_tokens=512)  # chunked prefill of the long one
    ours = generate_ids(engine, prompts)  # one continuous batch with ten different lengths
    check_against_reference(ours, hf_smollm2, prompts)


TINY_VARIANTS = {
    "llama-untied": {},
    "tied-embeddings": {"tie_word_embeddings": True},
    "qwen2-qkv-bias": {"attention_bias": True},
    "llama3-rope-scaling": {"rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 256)},
}


@pytest.mark.parametrize("variant", TINY_VARIANTS)
def test_tiny_variants_match_transformers(variant: str) -> None:
    loaded = tiny_model(**TINY_VARIANTS[variant])
    prompts = varied_prompts(loaded)
    ours = generate_ids(make_engine(loaded), prompts)
    check_against_reference(ours, hf_model_from(loaded), prompts)


def test_hf_directory_loads_like_transformers(tmp_path: object) -> None:
    """A Hugging Face checkpoint directory: our loader and transformers' from_pretrained agree."""
    from transformers import AutoModelForCausalLM

    directory = str(tmp_path)
    save_hf_dir(tiny_model(attention_bias=True), directory)
    loaded = load_model(directory)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompts = varied_prompts(loaded)
    check_against_reference(generate_ids(make_engine(loaded), prompts), hf, prompts)
