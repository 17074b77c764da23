"""Model loading: GGUF (against transformers), the weight cache, model ids, the tiny model and HF directories.

The `smollm2` and `hf_smollm2` fixtures are session-wide ones from conftest.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import gguf_loader
from engine.config import ModelConfig, RopeScaling
from engine.errors import ModelLoadError
from engine.hf_loader import config_from_hf, expected_shapes
from engine.loader import LoadedModel, load_model, save_hf_dir, tiny_model, tiny_model_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# llama.cpp's tensor names for our HF names (the inverse of what the loader undoes).
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
QWEN2_STYLE = {"attention_bias": True, "attention_out_bias": False}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private PDCLUSTER_CACHE_DIR for this test."""
    path = tmp_path / "cache"
    monkeypatch.setenv("PDCLUSTER_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[str, tuple[str, LoadedModel]]:
    """The tiny model written as a llama GGUF, and (a cache dir holding its load, that load)."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    path = write_gguf(tiny_model(), str(root / "tiny.gguf"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDCLUSTER_CACHE_DIR", str(root / "cache"))
        return path, (str(root / "cache"), load_model(path))


def _gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # What llama.cpp's convert_hf_to_gguf.py LlamaModel.permute does to q/k rows.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(model: LoadedModel, path: str, arch: str = "llama") -> str:
    """Write `model` as an F32 GGUF the way llama.cpp's converter would (q/k permuted for arch 'llama')."""
    c = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_basename("tiny")
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    backend = json.loads(json.loads(model.tokenizer.to_json())["tokenizer"])
    vocab = backend["model"]["vocab"]
    special = {t["id"] for t in backend["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(sorted(vocab, key=vocab.__getitem__))
    w.add_token_types([3 if i in special else 1 for i in range(len(vocab))])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in backend["model"]["merges"]])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_ids[0])
    w.add_add_bos_token(False)
    w.add_chat_template(model.tokenizer.chat_template)
    for name, t in model.weights.items():
        if arch == "llama" and ".q_proj." in name:
            t = _llama_cpp_permute(t, c.num_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = _llama_cpp_permute(t, c.num_kv_heads)
        w.add_tensor(_gguf_name(name), t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_smollm2_config(smollm2):
    c = smollm2.config
    assert (c.name, c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "smollm2", 30, 576, 1536, 9, 3, 64)
    assert (c.vocab_size, c.rope_theta, c.rope_scaling, c.rms_norm_eps, c.max_position_embeddings) == (
        49152, 100000.0, None, 1e-5, 8192)
    assert c.tie_word_embeddings and not c.attention_bias and not c.attention_out_bias
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert c.model_id.startswith("smollm2-135m-") and len(c.model_id.rsplit("-", 1)[1]) == 12
    assert smollm2.tokenizer.encode("<|im_end|>") == [2]


def test_smollm2_weights_are_float32_hf_layout(smollm2):
    shapes = expected_shapes(smollm2.config)
    assert "lm_head.weight" not in smollm2.weights
    assert {k: tuple(v.shape) for k, v in smollm2.weights.items()} == shapes
    assert all(v.dtype == torch.float32 and v.is_contiguous() and v.device.type == "cpu"
               for v in smollm2.weights.values())


@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smollm2, hf_smollm2):
    ref = hf_smollm2.state_dict()  # transformers' own GGUF loader (session fixture in conftest.py)
    for name in ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.17.self_attn.q_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight", "model.layers.5.self_attn.v_proj.weight",
                 "model.layers.5.self_attn.o_proj.weight", "model.layers.29.mlp.down_proj.weight",
                 "model.layers.0.input_layernorm.weight", "model.layers.3.post_attention_layernorm.weight"]:
        assert torch.equal(smollm2.weights[name], ref[name]), name
    assert ref.keys() - smollm2.weights.keys() == {"lm_head.weight"}
    assert torch.equal(ref["lm_head.weight"], smollm2.weights["model.embed_tokens.weight"])  # tied
    assert all(torch.equal(v, ref[k]) for k, v in smollm2.weights.items())


def test_second_load_is_served_from_cache(cache, tiny_gguf, monkeypatch):
    path, (first_cache, first) = tiny_gguf
    shutil.copytree(first_cache, cache)

    def no_dequantize(*args, **kwargs):
        raise AssertionError("cache miss: the GGUF was dequantized again")

    monkeypatch.setattr(gguf_loader, "gguf_weights", no_dequantize)
    second = load_model(path)
    assert second.config == first.config
    assert_same_weights(second.weights, first.weights)
    assert second.tokenizer.encode("Hi 😀 <|im_end|>") == first.tokenizer.encode("Hi 😀 <|im_end|>")
    assert second.tokenizer.chat_template == first.tokenizer.chat_template


@pytest.mark.parametrize("damage", ["truncate", "garbage", "other-source"])
def test_damaged_cache_is_rebuilt(cache, tiny_gguf, damage):
    path, (first_cache, first) = tiny_gguf
    shutil.copytree(first_cache, cache)
    (file,) = (cache / "gguf").glob("*.safetensors")
    if damage == "truncate":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif damage == "garbage":
        file.write_bytes(b"\x00\xffnot a safetensors file" * 100)
    else:  # a valid file whose metadata names another GGUF (e.g. a hash-prefix clash)
        save_file({"x": torch.zeros(1)}, str(file), metadata={"source": "elsewhere"})
    again = load_model(path)
    assert again.config == first.config
    assert_same_weights(again.weights, first.weights)
    assert load_file(str(file)).keys() == first.weights.keys()  # rewritten whole
    assert not list((cache / "gguf").glob("*.tmp"))


def test_model_id_is_stable_across_processes(smollm2):
    code = "from engine.loader import load_model; print(load_model('smollm2').config.model_id)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == smollm2.config.model_id


def test_gguf_model_id_ignores_where_the_file_sits(cache, tmp_path, tiny_gguf):
    original, (_, first) = tiny_gguf
    (tmp_path / "copy").mkdir()
    (tmp_path / "link").mkdir()
    copy = shutil.copy(original, tmp_path / "copy" / "other-name.gguf")
    link = tmp_path / "link" / "tiny.gguf"
    link.symlink_to(original)
    assert {load_model(str(p)).config.model_id for p in (copy, link)} == {first.config.model_id}
    assert first.config.model_id.startswith("tiny-") and first.config.model_id != "tiny-random-llama-v1"


def _config_fields(config: ModelConfig) -> dict:
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in ("name", "model_id")}


def test_gguf_llama_round_trip_undoes_permutation(tiny_gguf):
    _, (_, loaded) = tiny_gguf
    tiny = tiny_model()
    assert_same_weights(loaded.weights, tiny.weights)
    assert _config_fields(loaded.config) == _config_fields(tiny.config)
    assert loaded.config.name == "tiny"


def test_gguf_qwen2_is_not_permuted_and_shows_progress(cache, tmp_path, capsys):
    tiny = tiny_model(**QWEN2_STYLE)
    loaded = load_model(write_gguf(tiny, str(tmp_path / "qwen.gguf"), "qwen2"), progress=True)
    assert "dequantize" in capsys.readouterr().err
    assert_same_weights(loaded.weights, tiny.weights)
    assert _config_fields(loaded.config) == _config_fields(tiny.config)


def test_unsupported_gguf_architecture_raises(cache, tmp_path):
    writer = gguf.GGUFWriter(path := str(tmp_path / "g.gguf"), "gemma")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="gemma") as err:
        load_model(path)
    assert err.value.field == "model"


@pytest.mark.parametrize("kind", ["alias", "missing-gguf", "dir-without-config", "other-file", "not-gguf"])
def test_unknown_model_raises(tmp_path, kind):
    model = {"alias": "no-such-model", "missing-gguf": str(tmp_path / "missing.gguf"),
             "dir-without-config": str(tmp_path), "other-file": str(tmp_path / "weights.bin"),
             "not-gguf": str(tmp_path / "fake.gguf")}[kind]
    (tmp_path / "weights.bin").write_bytes(b"x")
    (tmp_path / "fake.gguf").write_bytes(b"this is not GGUF" * 10)
    with pytest.raises(ModelLoadError) as err:
        load_model(model)
    assert err.value.field == "model" and str(err.value).startswith("model:")
    assert (tmp_path.name in str(err.value)) or "no-such-model" in str(err.value)


def test_tiny_model_is_deterministic():
    a, b = load_model("tiny"), load_model("tiny")
    assert a.config == b.config and a.config.model_id == "tiny-random-llama-v1"
    assert_same_weights(a.weights, b.weights)
    c = a.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (
        2, 64, 4, 2, 16, 160)
    assert (c.vocab_size, c.tie_word_embeddings, c.eos_token_ids, c.bos_token_id) == (49152, False, (2,), 1)
    assert a.weights["model.embed_tokens.weight"].shape == (49152, 64)
    assert a.weights["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert a.weights["lm_head.weight"].std().item() == pytest.approx(1.0, abs=0.01)
    assert a.weights["model.layers.0.mlp.down_proj.weight"].std().item() == pytest.approx(160 ** -0.5, rel=0.05)
    assert not torch.equal(tiny_model(seed=1).weights["lm_head.weight"], a.weights["lm_head.weight"])


def test_tiny_variants_get_their_own_model_id():
    base, tied, biased = tiny_model(), tiny_model(tie_word_embeddings=True), tiny_model(**QWEN2_STYLE)
    assert len({base.config.model_id, tied.config.model_id, biased.config.model_id}) == 3
    assert tiny_model_config(tie_word_embeddings=True).model_id == tied.config.model_id  # stable
    assert "lm_head.weight" not in tied.weights and "model.layers.0.self_attn.q_proj.bias" in biased.weights
    assert torch.equal(tied.weights["model.embed_tokens.weight"], base.weights["model.embed_tokens.weight"])


@pytest.mark.parametrize("overrides", [{}, QWEN2_STYLE, {"tie_word_embeddings": True},
                                       {"attention_bias": True, "attention_out_bias": True},
                                       {"rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)}],
                         ids=["llama", "qwen2", "tied", "llama-bias", "llama3-rope"])
def test_save_hf_dir_round_trips(tmp_path, overrides):
    tiny = tiny_model(**overrides)
    save_hf_dir(tiny, str(tmp_path))
    loaded = load_model(str(tmp_path))
    assert loaded.config == dataclasses.replace(tiny.config, name=tmp_path.name, model_id=loaded.config.model_id)
    assert_same_weights(loaded.weights, tiny.weights)
    assert loaded.tokenizer.encode("Hi <|im_end|> 123") == tiny.tokenizer.encode("Hi <|im_end|> 123")
    assert load_model(str(tmp_path)).config.model_id == loaded.config.model_id


@pytest.mark.parametrize("overrides, cls", [({}, "LlamaForCausalLM"), (QWEN2_STYLE, "Qwen2ForCausalLM"),
                                            ({"tie_word_embeddings": True}, "LlamaForCausalLM")])
def test_transformers_loads_saved_hf_dir(tmp_path, overrides, cls):
    transformers = pytest.importorskip("transformers")
    tiny = tiny_model(**overrides)
    save_hf_dir(tiny, str(tmp_path))
    model, info = getattr(transformers, cls).from_pretrained(str(tmp_path), output_loading_info=True,
                                                               dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in tiny.weights.items())
    assert model.config.rope_parameters["rope_theta"] == tiny.config.rope_theta
    assert model.config.head_dim == tiny.config.head_dim


def test_hf_dir_sharded_bf16(tmp_path):
    tiny = tiny_model()
    save_hf_dir(tiny, str(tmp_path))
    os.remove(tmp_path / "model.safetensors")
    names = sorted(tiny.weights)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: tiny.weights[k].to(torch.bfloat16) for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_model(str(tmp_path))
    expected = {k: v.to(torch.bfloat16).to(torch.float32) for k, v in tiny.weights.items()}
    assert all(v.dtype == torch.float32 for v in loaded.weights.values())
    assert_same_weights(loaded.weights, expected)


def test_hf_dir_with_missing_weight_raises(tmp_path):
    tiny = tiny_model()
    save_hf_dir(tiny, str(tmp_path))
    save_file({k: v for k, v in tiny.weights.items() if k != "model.norm.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.norm.weight") as err:
        load_model(str(tmp_path))
    assert err.value.field == "model"


BASE_HF = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize("extra, expected", [
    ({}, None),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, RopeScaling("linear", 2.0)),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)),
    ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5}}, RopeScaling("linear", 4.0)),
])
def test_hf_config_rope_scaling(extra, expected):
    config = config_from_hf(BASE_HF | extra, {}, name="m", model_id="m-1")
    assert config.rope_scaling == expected
    assert config.rope_theta == (5e5 if "rope_parameters" in extra else 10000.0)


def test_hf_config_eos_bias_and_unsupported():
    gen = {"eos_token_id": [7, 8], "bos_token_id": 1}
    config = config_from_hf(BASE_HF | {"eos_token_id": 8, "attention_bias": True}, gen, name="m", model_id="m-1")
    assert (config.eos_token_ids, config.bos_token_id, config.attention_bias, config.attention_out_bias) == (
        (7, 8), 1, True, True)
    qwen = config_from_hf(BASE_HF | {"architectures": ["Qwen2ForCausalLM"]}, {}, name="q", model_id="q-1")
    assert (qwen.attention_bias, qwen.attention_out_bias) == (True, False)
    for bad in [{"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, {"architectures": ["GPT2LMHeadModel"]}]:
        with pytest.raises(ModelLoadError) as err:
            config_from_hf(BASE_HF | bad, {}, name="m", model_id="m-1")
        assert err.value.field == "model"


def test_a_gguf_loads_into_bfloat16_from_the_cache_and_a_miss_writes_no_float32_cache(cache, tiny_gguf):
    # NOTE: the cache holds float32; a bf16 load converts tensor by tensor and, on a miss, never builds the float32
    # model to write it (issue 26: an 8B model must load to a GPU without a float32 host copy)
    path, (first_cache, first) = tiny_gguf
    miss = load_model(path, dtype="bfloat16")
    assert {w.dtype for w in miss.weights.values()} == {torch.bfloat16} and not os.path.exists(cache)
    shutil.copytree(first_cache, cache)
    hit = load_model(path, dtype="bfloat16")
    assert all(torch.equal(hit.weights[k], w.bfloat16()) for k, w in first.weights.items())
    assert all(torch.equal(miss.weights[k], w) for k, w in hit.weights.items())
