"""The engine on a CUDA GPU (issue 26): correctness against the CPU and transformers, CUDA graphs against eager
steps, the KV pool sized by gpu_memory_utilization, the request features (penalties, logit bias, logprobs, n > 1,
min_p, n-gram speculation) against the CPU. Marked gpu; skipped without CUDA, so never in CI: they run on a
lent GPU through scripts/gpu-check.sh (which records the two correctness checks' figures in its JSON summary)."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader import load_model, save_hf_dir
from engine.quality import greedy_outputs
from pdcluster.bench.engine_gpu import bf16_matches_transformers, device_matches_cpu, make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def smollm2_bf16():
    return load_model("random:smollm2-135m", device="cuda", dtype="bfloat16")


def test_float32_greedy_on_cuda_equals_the_cpu_but_at_near_ties():
    result = device_matches_cpu("cuda")
    assert result["passed"], result


def test_bfloat16_greedy_matches_transformers_on_at_least_9_of_10_prompts():
    result = bf16_matches_transformers("cuda")
    assert result["passed"], result


def _engine(loaded, **kw) -> LLMEngine:
    cfg = dict(device="cuda", num_blocks=512, max_num_seqs=8, max_num_batched_tokens=1024,
               enable_prefix_caching=False) | kw
    return LLMEngine(loaded, EngineConfig(**cfg))  # type: ignore[arg-type]


def test_cuda_graphs_give_the_eager_tokens_at_every_batch_size_and_padding():
    # NOTE: float32, so the two paths' different split-KV counts (a graph's block tables are as wide as the longest
    # sequence may grow) cannot flip a near-tie of the random model's flat logits
    fp32 = load_model("random:smollm2-135m", device="cuda", dtype="float32")
    graphed = _engine(fp32)
    eager = _engine(fp32, enforce_eager=True)
    assert graphed.runner.graphs is not None and sorted(graphed.runner.graphs.graphs) == [1, 2, 4, 8]
    assert eager.runner.graphs is None
    replays = 0
    run = graphed.runner.graphs.run

    def counting(*args, **kwargs):
        nonlocal replays
        replays += 1
        return run(*args, **kwargs)

    graphed.runner.graphs.run = counting  # type: ignore[method-assign]
    for n in (1, 3, 5, 8):  # 3 and 5 pad to the buckets 4 and 8
        prompts = make_prompts(n, 20 + n, seed=n)
        assert greedy_outputs(graphed, prompts, 12) == greedy_outputs(eager, prompts, 12)
    assert replays > 0


def test_bfloat16_is_the_default_on_cuda_and_the_weights_live_there(smollm2_bf16):
    engine = _engine(smollm2_bf16)
    assert engine.runner.kv.device.type == "cuda" and engine.runner.kv.dtype == torch.bfloat16
    assert engine.runner.model.embed.device.type == "cuda"


def test_an_hf_checkpoint_loads_onto_the_gpu_in_bfloat16(tmp_path):
    tiny = load_model("tiny")
    save_hf_dir(tiny, str(tmp_path))
    loaded = load_model(str(tmp_path), device="cuda", dtype="auto")
    assert {(w.device.type, w.dtype) for w in loaded.weights.values()} == {("cuda", torch.bfloat16)}


def test_gpu_memory_utilization_sizes_the_kv_pool_within_the_share(smollm2_bf16):
    total = torch.cuda.mem_get_info()[1]
    small = LLMEngine(smollm2_bf16, EngineConfig(device="cuda", gpu_memory_utilization=0.2, max_num_seqs=4096,
                                                 enforce_eager=True))
    small_blocks = small.runner.num_blocks
    assert small_blocks > 0 and torch.cuda.memory_reserved() < 0.2 * total + 2**30
    del small
    torch.cuda.empty_cache()
    big = LLMEngine(smollm2_bf16, EngineConfig(device="cuda", gpu_memory_utilization=0.4, max_num_seqs=4096,
                                               enforce_eager=True))
    assert big.runner.num_blocks > 1.5 * small_blocks


# ---- request features on the GPU -----------------------------------------------------------------------------
# NOTE: greedy, so a CUDA engine and a CPU engine over the same float32 weights must agree token for token (near-ties
# aside: the fp32 check above finds none on these prompts' lengths); structured outputs are left out (xgrammar and
# its imports, pydantic among them, are not on a lent GPU machine; its bitmask is applied by device-generic torch)
GREEDY_FEATURES: dict[str, dict[str, object]] = {
    "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
    "logit_bias": dict(logit_bias={1000 + i: 4.0 for i in range(0, 40, 3)} | {2000: -100.0}),
    "logprobs": dict(logprobs=3, prompt_logprobs=2),
    "n": dict(n=2),
    "min_p": dict(min_p=0.05, top_k=20),
}


def _feature_run(loaded, device: str, **cfg) -> dict[str, tuple[list[int], list[float]]]:
    """Per request id (n > 1: its choices too): token ids, and every logprob it got (each sampled token's, then its
    top-k values, descending; then the prompt tokens' likewise).

    NOTE: values, not the top-k token ids: two alternatives a float32 rounding apart may swap places between devices.
    """
    engine = LLMEngine(loaded, EngineConfig(device=device, dtype="float32", num_blocks=512, max_num_seqs=8,
                                            max_num_batched_tokens=1024, enable_prefix_caching=False, **cfg))
    prompts = make_prompts(len(GREEDY_FEATURES), 24, seed=26)
    for prompt, (name, kw) in zip(prompts, GREEDY_FEATURES.items()):
        engine.add_request(name, prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **kw))
    values: dict[str, list[float]] = {}
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            entries = [*out.new_logprobs, *(lp for lp in out.prompt_logprobs or [] if lp is not None)]
            got = values.setdefault(out.request_id, [])
            got += [v for lp in entries for v in (lp.logprob, *(x for _, x in lp.top))]
            if out.finished:
                final[out.request_id] = out.token_ids
    return {rid: (ids, values.get(rid, [])) for rid, ids in final.items()}


def test_request_features_on_cuda_give_the_cpus_tokens_and_logprobs():
    """Penalties, logit bias, logprobs and prompt logprobs, n = 2, min_p with top_k: CUDA (with its CUDA graphs and the
    decode lookahead) and the CPU agree on every token, and on every logprob within float32 rounding."""
    on_cuda = load_model("random:smollm2-135m", device="cuda", dtype="float32")
    on_cpu = load_model("random:smollm2-135m", device="cpu", dtype="float32")
    ours, ref = _feature_run(on_cuda, "cuda"), _feature_run(on_cpu, "cpu")
    assert sorted(ours) == sorted(ref) == sorted([*GREEDY_FEATURES, "n-1"])
    for rid, (ids, lps) in ref.items():
        got_ids, got_lps = ours[rid]
        assert got_ids == ids and len(ids) == 16, rid
        assert len(got_lps) == len(lps) and torch.allclose(torch.tensor(got_lps), torch.tensor(lps), atol=1e-3), rid
    assert ref["n"][0] == ref["n-1"][0]  # greedy choices are one answer
    assert len(ref["logprobs"][1]) == 16 * (1 + 3) + 23 * (1 + 2)  # sampled tokens, then prompt tokens but the first


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_ngram_speculation_on_cuda_keeps_greedy_tokens_and_samples_reproducibly():
    """Drafts verified on the GPU: greedy output token-identical to plain decoding there; sampled (the rejection
    rule draws from the request's own stream on the logits' device) the same tokens for the same seed."""
    fp32 = load_model("random:smollm2-135m", device="cuda", dtype="float32")
    # NOTE: a prompt that repeats itself, so prompt lookup finds drafts
    prompt = (make_prompts(1, 12, seed=3)[0] * 4)[:40]

    def run(spec: dict | None, params: SamplingParams) -> tuple[list[int], int]:
        engine = _engine(fp32, speculative_config=spec)
        engine.add_request("s", prompt, params)
        out = []
        while engine.has_unfinished_requests():
            out += [o.token_ids for o in engine.step() if o.finished]
        return out[0], engine.stats().spec_draft_tokens

    greedy_params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    plain, _ = run(None, greedy_params)
    spec, drafted = run(SPEC, greedy_params)
    assert spec == plain and drafted > 0
    # NOTE: a low temperature, so the sampled tokens follow the prompt's pattern and drafts are made (on the CPU:
    # 16 drafted, 13 accepted: the rejection rule's both branches)
    sampled = SamplingParams(max_tokens=32, temperature=0.05, seed=11, ignore_eos=True)
    first, drafted = run(SPEC, sampled)
    again, _ = run(SPEC, sampled)
    assert first == again and len(first) == 32 and drafted > 0


def test_the_fused_weights_are_the_only_copy_on_the_gpu():
    """engine/model.py's fused q/k/v and gate/up replace the loaded tensors (views), so building an engine adds its
    KV pool and little else to the GPU's allocations (before: a second copy of half of SmolLM2's weights)."""
    loaded = load_model("random:smollm2-135m", device="cuda", dtype="bfloat16")
    weight_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in loaded.weights.values()}.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = _engine(loaded, enforce_eager=True)
    grown = torch.cuda.memory_allocated() - before
    kv = engine.runner.kv.numel() * engine.runner.kv.element_size()
    assert grown < kv + 0.2 * weight_bytes, (grown, kv, weight_bytes)


def test_int8_kv_and_int8_weights_on_cuda():
    """An int8 KV cache on CUDA (the gather path quantizes and reads it on the device) gives the CPU's greedy tokens
    over the same float32 weights; int8 weights serve where torch has the CUDA kernel, else are refused naming
    `quantization` (engine/linear.py)."""
    from engine.errors import InvalidRequestError

    prompts = make_prompts(4, 24, seed=8)
    on_cuda = load_model("random:smollm2-135m", device="cuda", dtype="float32")
    on_cpu = load_model("random:smollm2-135m", device="cpu", dtype="float32")
    cuda_int8 = LLMEngine(on_cuda, EngineConfig(device="cuda", dtype="float32", num_blocks=256, kv_cache_dtype="int8"))
    cpu_int8 = LLMEngine(on_cpu, EngineConfig(device="cpu", dtype="float32", num_blocks=256, kv_cache_dtype="int8"))
    assert cuda_int8.runner.kv.dtype == torch.int8
    assert greedy_outputs(cuda_int8, prompts, 16) == greedy_outputs(cpu_int8, prompts, 16)
    try:
        quantized = _engine(load_model("random:smollm2-135m", device="cuda", dtype="bfloat16"), quantization="int8")
    except InvalidRequestError as e:
        assert e.field == "quantization", e
        return
    assert all(len(t) == 8 for t in greedy_outputs(quantized, prompts, 8))


def test_kv_cache_memory_gb_sizes_a_gpu_pool_when_set(smollm2_bf16):
    """A set kv_cache_memory_gb wins over the GPU share on CUDA (vLLM's kv_cache_memory_bytes; the shipped GPU YAMLs
    set it), instead of being ignored."""
    engine = LLMEngine(smollm2_bf16, EngineConfig(device="cuda", kv_cache_memory_gb=0.25, enforce_eager=True))
    per_block = engine.runner.kv[:, :, 0].numel() * engine.runner.kv.element_size()
    assert engine.runner.num_blocks == int(0.25 * 2**30 // per_block)  # NOTE: below max_num_seqs' cap here
