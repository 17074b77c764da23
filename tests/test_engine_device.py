"""The engine's device and dtype (issue 26): config, loading, random-weight models, a step with no host tensors,
and the CUDA-graph bookkeeping that runs without a GPU. GPU behaviour itself: tests/test_engine_gpu.py (marked gpu)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine import EngineConfig, SamplingParams
from engine.config import resolve_dtype
from engine.cuda_graphs import GraphBucket, bucket_for, graph_buckets, graphs_wanted
from engine.errors import InvalidRequestError, ModelLoadError
from engine.gpu_memory import kv_budget_bytes
from engine.hf_loader import load_hf_dir
from engine.loader import LoadedModel, load_model, save_hf_dir
from engine.model_runner import ModelRunner
from engine.random_model import random_model_config, random_weights
from pdcluster.config import ClusterConfig, ConfigError
from tests.helpers import make_engine, random_prompts

NO_CUDA = not torch.cuda.is_available()


# ---- device and dtype in the config ---------------------------------------------------------------------------

def test_dtype_auto_is_float32_on_the_cpu_and_bfloat16_on_cuda():
    assert EngineConfig().torch_dtype == torch.float32
    assert resolve_dtype("auto", "cuda:1") == torch.bfloat16
    assert EngineConfig(dtype="float16").torch_dtype == torch.float16


@pytest.mark.parametrize("kwargs,field", [({"device": "gpu"}, "device"), ({"device": "cuda:x"}, "device"),
                                          ({"gpu_memory_utilization": 0.9}, "gpu_memory_utilization"),
                                          ({"device": "cuda", "gpu_memory_utilization": 1.5},
                                           "gpu_memory_utilization"),
                                          ({"device": "cuda", "gpu_memory_utilization": 0.5, "kv_cache_memory_gb": 4},
                                           "kv_cache_memory_gb")])
def test_bad_device_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        EngineConfig(**kwargs)
    assert info.value.field == field


@pytest.mark.skipif(not NO_CUDA, reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_at_load_naming_device(tiny):
    with pytest.raises(InvalidRequestError) as info:
        load_model("tiny", device="cuda")
    assert info.value.field == "device" and "use device 'cpu'" in str(info.value)
    with pytest.raises(InvalidRequestError) as info:
        make_engine(tiny, device="cuda:0")
    assert info.value.field == "device"


def _lines(*rows: str) -> str:
    return "\n".join(rows) + "\n"


def test_a_cuda_pool_passes_device_memory_share_and_eager_to_its_engine():
    cfg = ClusterConfig.from_yaml_text(_lines(
        "mode: colocated", "colocated:", "  replicas: 1", "  num_gpus: 1", "  device: cuda",
        "  gpu_memory_utilization: 0.8", "  enforce_eager: true"))
    ec = cfg.colocated.engine_config()
    assert (ec.device, ec.dtype, ec.torch_dtype, ec.gpu_memory_utilization, ec.enforce_eager) == (
        "cuda", "auto", torch.bfloat16, 0.8, True)


def test_pool_settings_for_a_gpu_on_a_cpu_pool_or_auto_dtypes_that_differ_are_refused():
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_yaml_text(_lines("prefill:", "  gpu_memory_utilization: 0.5"))
    assert info.value.path == "prefill.gpu_memory_utilization"
    # NOTE: auto is bfloat16 on a cuda pool and float32 on a cpu pool: their KV cannot move between them as it is
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_yaml_text(_lines("prefill:", "  num_gpus: 1", "  device: cuda", "decode:", "  replicas: 1"))
    assert info.value.path == "decode.dtype" and "'bfloat16'" in str(info.value)
    # NOTE: both size a GPU's KV pool (a set kv_cache_memory_gb wins over the share, as vLLM's kv_cache_memory_bytes)
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_yaml_text(_lines("prefill:", "  num_gpus: 1", "  device: cuda", "  kv_cache_memory_gb: 4",
                                            "  gpu_memory_utilization: 0.5"))
    assert info.value.path == "prefill.kv_cache_memory_gb"


# ---- loading to a dtype and device -----------------------------------------------------------------------------

def test_an_engine_keeps_one_copy_of_the_weights_it_fuses(tmp_path):
    """engine/model.py fuses q/k/v and gate/up into one matmul each; the loaded weights then become views of the fused
    tensors, so the originals are not kept beside them (on a GPU: memory for the KV pool); the views save and load
    as the weights they were."""
    loaded = load_model("tiny")
    before = {k: v.clone() for k, v in loaded.weights.items()}
    make_engine(loaded)
    w = loaded.weights
    for layer in range(loaded.config.num_layers):
        a, m = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.mlp."
        for group in ([a + f"{n}_proj.weight" for n in "qkv"], [m + "gate_proj.weight", m + "up_proj.weight"]):
            assert len({w[n].untyped_storage().data_ptr() for n in group}) == 1, group
    assert all(torch.equal(w[k], v) for k, v in before.items())
    save_hf_dir(loaded, str(tmp_path))
    again = load_model(str(tmp_path))
    assert all(torch.equal(again.weights[k], v) for k, v in before.items() if k in again.weights)


def test_an_hf_directory_loads_straight_into_bfloat16(tiny, tmp_path):
    save_hf_dir(tiny, str(tmp_path))
    _, weights, _ = load_hf_dir(str(tmp_path), "tiny", "cpu", torch.bfloat16)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    assert all(torch.equal(weights[k], w.bfloat16()) for k, w in tiny.weights.items())


def test_random_models_have_the_real_architectures_and_are_refused_by_unknown_name():
    llama = random_model_config("random:llama-3.1-8b")
    assert (llama.num_layers, llama.hidden_size, llama.num_kv_heads, llama.vocab_size) == (32, 4096, 8, 128256)
    assert llama.rope_scaling is not None and llama.rope_scaling.rope_type == "llama3"
    qwen = random_model_config("random:qwen2.5-7b")
    assert (qwen.num_layers, qwen.intermediate_size, qwen.attention_bias, qwen.attention_out_bias) == (
        28, 18944, True, False)
    with pytest.raises(ModelLoadError) as info:
        load_model("random:llama-9b")
    assert "random:smollm2-135m" in str(info.value)


def test_an_8b_random_model_is_made_on_the_target_device_in_the_target_dtype():
    # NOTE: the meta device makes every tensor without memory: the full 8B model in a moment, no host copy
    loaded = load_model("random:llama-3.1-8b", device=torch.device("meta"), dtype="bfloat16")
    ws = loaded.weights.values()
    assert {(w.device.type, w.dtype) for w in ws} == {("meta", torch.bfloat16)}
    assert 8.0e9 < sum(w.numel() for w in ws) < 8.1e9


@pytest.fixture(scope="module")
def smollm2_random() -> LoadedModel:
    """random:smollm2-135m cut to 2 of its 30 layers (the same tensors by name; CI time)."""
    config = dataclasses.replace(random_model_config("random:smollm2-135m"), num_layers=2)
    return LoadedModel(config, random_weights(config), load_model("tiny").tokenizer)


def test_random_weights_are_seeded_sane_and_the_same_in_every_dtype(smollm2_random):
    w = smollm2_random.weights
    embed = w["model.embed_tokens.weight"]
    assert abs(float(embed.std()) - 0.02) < 1e-3 and float(w["model.norm.weight"].min()) == 1.0
    bf16 = random_weights(smollm2_random.config, dtype=torch.bfloat16)
    assert all(torch.equal(bf16[k], w[k].bfloat16()) for k in w)
    assert not torch.equal(w["model.layers.0.mlp.up_proj.weight"], w["model.layers.1.mlp.up_proj.weight"])


def test_a_random_model_serves_greedy_tokens_like_any_model(smollm2_random):
    engine = make_engine(smollm2_random, num_blocks=64)
    engine.add_request("r", random_prompts(1, [20], seed=3)[0], SamplingParams(max_tokens=4, ignore_eos=True,
                                                                                temperature=0))
    while engine.has_unfinished_requests():
        out = engine.step()
    assert len(out[0].token_ids) == 4 and out[0].finished


# ---- no host tensors on the step path --------------------------------------------------------------------------

_SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default,
          torch.ops.aten.nonzero.default}


class HostGuard(TorchDispatchMode):
    """Records ops that sync a device tensor to the host, and (strict) any op whose output lives on the CPU."""

    def __init__(self, strict: bool) -> None:
        super().__init__()
        self.strict = strict
        self.violations: list[str] = []
        self.uploads = 0  # copies from a host tensor to the device

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)]
        if func in _SYNCS and any(t.device.type != "cpu" for t in inputs):
            self.violations.append(f"{func} syncs to the host")
        out = func(*args, **(kwargs or {}))
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.strict and any(t.device.type == "cpu" for t in outputs):
            self.violations.append(f"{func} made a CPU tensor")
        if any(t.device.type == "cpu" for t in inputs) and any(t.device.type == "meta" for t in outputs):
            self.uploads += 1
        return out


@pytest.fixture
def meta_runner(tiny) -> Iterator[tuple[Any, ModelRunner]]:
    engine = make_engine(tiny, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    cfg = EngineConfig(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    yield engine, ModelRunner(tiny.config, cfg, tiny.weights, 64, 512, device=torch.device("meta"))


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_step_on_a_device_makes_no_host_tensor_and_never_syncs(meta_runner, phase):
    """Issue 26: the model and the runner build every per-step tensor on the host and copy it once; the forward pass
    and the logits run with no host tensor and no sync (the meta device stands in for a GPU: any CPU tensor or
    `.item()` inside would show)."""
    engine, runner = meta_runner
    assert runner.attn_backend == "gather"  # NOTE: the torch reference path; the Triton path is tested on CUDA
    for i, prompt in enumerate(random_prompts(3, [40, 7, 23], vocab=1000, seed=11)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    if phase == "decode":
        engine.step()  # the prompts' prefill, on the CPU engine
    batch = engine.scheduler.schedule()
    assert all(n == 1 for n in batch.num_new_tokens) == (phase == "decode")
    with HostGuard(strict=False) as host_side:  # building the step on the host: no sync, few uploads
        step = runner.prepare(batch)
    with HostGuard(strict=True) as device_side:  # the forward pass and the logits: nothing on the host
        logits = runner.forward(batch, step)
    assert host_side.violations == [] and device_side.violations == []
    assert host_side.uploads <= 2  # the attention metadata's pack and the ids/positions/rows pack
    assert logits is not None and logits.device.type == "meta" and tuple(logits.shape) == (3, tiny_vocab(engine))


def tiny_vocab(engine: Any) -> int:
    return int(engine.model_config.vocab_size)


# ---- CUDA graphs: what the CPU can check ------------------------------------------------------------------------

@pytest.mark.parametrize("max_num_seqs,buckets", [(1, [1]), (8, [1, 2, 4, 8]), (48, [1, 2, 4, 8, 16, 32, 48]),
                                                  (64, [1, 2, 4, 8, 16, 32, 64])])
def test_graph_buckets_cover_every_batch_size_up_to_max_num_seqs(max_num_seqs, buckets):
    assert graph_buckets(max_num_seqs) == buckets
    assert all(bucket_for(n, buckets) == min(b for b in buckets if b >= n) for n in range(1, max_num_seqs + 1))
    assert bucket_for(max_num_seqs + 1, buckets) is None


def test_a_graphs_staged_step_is_what_the_metadata_builder_lays_out():
    """A bucket's host staging (engine/cuda_graphs.py) against AttentionMetadata.build for the same padded step: the
    slots, lengths and the table columns the kernels read; padded rows feed token 0 at position 0 into the spare
    block; a second, shorter step leaves no row reading the first's values; too many rows or too wide a table raise."""
    from engine.attention import AttentionMetadata

    bs, spare, width, rows = 16, 40, 8, 4
    static = AttentionMetadata.build([[spare]] * rows, [0] * rows, [1] * rows, bs, device="cpu", backend="triton",
                                     pad_blocks=width, pad_block=spare)
    g = GraphBucket(rows, torch.zeros(2, rows, dtype=torch.long), static, cuda=False)
    for tables, starts, ids in [([[3, 9, 12], [5], [7, 8]], [40, 2, 17], [11, 22, 33]), ([[6, 2]], [20], [44])]:
        n = len(ids)
        g.stage(ids, starts, tables, starts, bs, spare)  # a decode row's position is its start
        g.upload()
        want = AttentionMetadata.build(tables, starts, [1] * n, bs, device="cpu", backend="triton", pad_rows=rows,
                                       pad_blocks=width, pad_block=spare)
        assert want.triton is not None and static.triton is not None
        assert torch.equal(static.slot_mapping, want.slot_mapping)
        assert torch.equal(static.triton.seq_lens, want.triton.seq_lens)
        for i, length in enumerate(want.triton.seq_lens.tolist()):
            used = -(-length // bs)
            assert torch.equal(static.triton.block_tables[i, :used], want.triton.block_tables[i, :used])
        assert g.ids_pos.tolist() == [ids + [0] * (rows - n), starts + [0] * (rows - n)]
    with pytest.raises(ValueError):
        g.stage([1] * 5, [0] * 5, [[1]] * 5, [0] * 5, bs, spare)
    with pytest.raises(ValueError):
        g.stage([1], [0], [list(range(width + 1))], [0], bs, spare)


def test_graphs_are_only_tried_on_cuda_with_triton_and_enforce_eager_turns_them_off(tiny):
    cuda = torch.device("cuda", 0)
    assert graphs_wanted(cuda, "triton", enforce_eager=False)
    assert not graphs_wanted(cuda, "triton", enforce_eager=True)
    assert not graphs_wanted(cuda, "gather", enforce_eager=False)
    assert not graphs_wanted(torch.device("cpu"), "triton", enforce_eager=False)
    assert make_engine(tiny, num_blocks=16).runner.graphs is None


def test_the_kv_pool_gets_the_memory_share_left_after_the_profiled_peak():
    gib = 2**30
    # 80 GiB at 0.9 = 72; the peak 20 GiB held a 1 GiB profiling pool: 72 - 19 = 53 (this engine's share: what other
    # processes hold is not taken from it, as in vLLM; a share that does not fit in what is free is refused)
    assert kv_budget_bytes(80 * gib, 0.9, 20 * gib, 1 * gib) == 53 * gib


def test_the_runner_keeps_a_spare_block_outside_the_block_manager(tiny):
    engine = make_engine(tiny, num_blocks=16)
    assert (len(engine.block_manager.pool.blocks), engine.runner.spare_block, engine.runner.kv.shape[2]) == (16, 16, 17)



# ---- the device bench runs anywhere ------------------------------------------------------------------------------

def test_the_device_bench_runs_on_the_cpu_and_reports_its_limits(tmp_path):
    from pdcluster.bench.engine_device import main

    out = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--model", "tiny", "--device-batches", "1,2", "--context", "16",
                 "--prefill-tokens", "32", "--decode-tokens", "4", "--repeats", "1", "--no-reference",
                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["decode"]) == {"1", "2"} and r["decode"]["1"]["ours_eager_tok_s"] > 0
    lim, cfg = r["limits"], load_model("tiny").config
    # the bound is what one copy of the weights and the context's KV per token allows at the measured bandwidth
    params = sum(w.numel() for k, w in load_model("tiny").weights.items()
                 if k != "model.embed_tokens.weight" or cfg.tie_word_embeddings)
    assert lim["weight_bytes"] == params * 4  # float32
    assert lim["kv_bytes_at_context"] == 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    bound = lim["copy_bandwidth_gb_s"] * 1e9 / (lim["weight_bytes"] + lim["kv_bytes_at_context"])
    assert lim["decode_bound_tok_s_batch1"] == pytest.approx(bound)
    assert lim["decode_batch1_share_of_bound"] == pytest.approx(r["decode"]["1"]["ours_eager_tok_s"] / bound)
    assert r["cuda_graphs"] is False and r["dtype"] == "float32"
