"""The engine on a CUDA GPU (issue 26): correctness against the CPU and transformers, CUDA graphs against eager
steps, the KV pool sized by gpu_memory_utilization. Marked gpu; skipped without CUDA, so never in CI: they run on a
lent GPU through scripts/gpu-check.sh (which records the two correctness checks' figures in its JSON summary)."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine
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

    def counting(*args):
        nonlocal replays
        replays += 1
        return run(*args)

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
