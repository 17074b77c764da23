"""The GGUF/HF tokenizer against transformers' reference, the chat template, and incremental detokenization."""

from __future__ import annotations

import json
import os

import gguf
import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import processors

from engine.errors import ModelLoadError
from engine.loader import smollm2_path
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # recursive\n",
    "12345",
    "pi = 3.14159, year 2024-11-21, 1,000,000",
    "a   b\t\tc    \n\n\n  d   ",
    "line1\nline2\r\nline3\n\n",
    " leading space",
    "emoji 😀👍🏽🇫🇷 and 👨‍👩‍👧",
    "中文测试，日本語のテキスト、한국어",
    "Ça va? Naïve café résumé Straße, Ελληνικά, русский",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>x<repo_name>y",
    "",
]

CONVERSATIONS = {
    "system-user-assistant": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? 🙂"},
    ],
    "user-only": [{"role": "user", "content": "Hi there!"}],
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(smollm2_path()))


@pytest.fixture(scope="module")
def ref():  # transformers' tokenizer for the same GGUF (~3 s)
    transformers = pytest.importorskip("transformers")
    path = smollm2_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def _write_vocab_gguf(path: str, *, model: str = "gpt2", pre: str = "gpt2") -> str:
    """A GGUF holding only a three-token byte-level vocabulary ('a', 'b', 'ab')."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b", "ab", "<|eos|>"])
    writer.add_token_types([1, 1, 1, 3])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(3)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(tok, ref, text):
    assert tok.encode(text) == ref.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(tok, ref, text):
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def test_special_tokens_stay_whole_and_are_skipped(tok):
    ids = tok.encode("<|im_start|>assistant\nok<|im_end|>")
    assert ids[0] == tok.bos_token_id == 1 and ids[-1] == tok.eos_token_id == 2
    assert tok.is_special(1) and tok.is_special(2) and tok.is_special(0) and not tok.is_special(ids[1])
    assert tok.decode(ids) == "assistant\nok"
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x", add_special_tokens=False)  # add_bos False


def test_smollm2_tokenizer_fields(tok):
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.add_bos) == (49152, 1, 2, False)
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chat_template_matches_transformers(tok, ref, name):
    messages = CONVERSATIONS[name]
    expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False)


def test_chat_template_missing_raises(tok):
    data = json.loads(tok.to_json()) | {"chat_template": None}
    with pytest.raises(ModelLoadError) as err:
        Tokenizer.from_json(json.dumps(data)).apply_chat_template([{"role": "user", "content": "hi"}])
    assert err.value.field == "chat_template"


def test_chat_template_raise_exception_helper(tok):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}{{ bos_token }}"
    custom = Tokenizer.from_json(json.dumps(json.loads(tok.to_json()) | {"chat_template": template}))
    assert custom.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>"
    with pytest.raises(jinja2.TemplateError, match="user first"):
        custom.apply_chat_template([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_agrees_with_decode(tok, text, skip_special_tokens):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.flush() == ""


def test_incremental_detokenizer_holds_back_partial_characters(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # one emoji spans several byte-level tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]
    cut = IncrementalDetokenizer(tok)
    assert cut.add(ids[0]) == ""
    assert cut.flush() == tok.decode(ids[:1]) == "\ufffd" and cut.text == "\ufffd"


def test_save_hf_round_trips(tok, ref, tmp_path):
    tok.save_hf(str(tmp_path))
    back = Tokenizer.from_hf_dir(str(tmp_path))
    assert [back.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
    assert (back.vocab_size, back.bos_token_id, back.eos_token_id, back.add_bos, back.chat_template) == (
        tok.vocab_size, tok.bos_token_id, tok.eos_token_id, tok.add_bos, tok.chat_template)
    messages = CONVERSATIONS["user-only"]
    assert back.apply_chat_template(messages) == tok.apply_chat_template(messages)
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert [hf.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_from_hf_dir_reads_bos_from_post_processor(tok, tmp_path):
    tok.save_hf(str(tmp_path))
    backend = Backend.from_file(str(tmp_path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[
        ("<|im_start|>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["add_bos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    back = Tokenizer.from_hf_dir(str(tmp_path))
    assert back.add_bos
    assert back.encode("hi") == [1, *tok.encode("hi")]  # BOS once, not twice
    assert back.encode("hi", add_special_tokens=False) == tok.encode("hi")


def test_from_hf_dir_without_tokenizer_json_raises(tmp_path):
    with pytest.raises(ModelLoadError) as err:
        Tokenizer.from_hf_dir(str(tmp_path))
    assert err.value.field == "model"


def test_small_gguf_vocabulary(tmp_path):
    small = Tokenizer.from_gguf(gguf.GGUFReader(_write_vocab_gguf(str(tmp_path / "v.gguf"))))
    assert small.encode("abab<|eos|>") == [2, 2, 3]
    assert small.decode([2, 3]) == "ab" and small.is_special(3)
    assert small.chat_template is None


@pytest.mark.parametrize("model, pre", [("llama", "default"), ("gpt2", "no-such-pre")])
def test_unsupported_gguf_tokenizer_raises(tmp_path, model, pre):
    reader = gguf.GGUFReader(_write_vocab_gguf(str(tmp_path / "v.gguf"), model=model, pre=pre))
    with pytest.raises(ModelLoadError, match=model if model != "gpt2" else pre) as err:
        Tokenizer.from_gguf(reader)
    assert err.value.field == "model"


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_of_any_ids_is_the_decoded_text(tok, seed, skip_special_tokens):
    # NOTE: random ids split characters anywhere (byte tokens, special tokens between them): the stream (tokenizers'
    # DecodeStream) must still add up to one decode of every id, never emit half a character, and flush the rest
    import random

    rng = random.Random(seed)
    ids = [rng.choice([0, 1, 2, rng.randrange(3, 300), rng.randrange(tok.vocab_size)]) for _ in range(80)]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == detok.text == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_detokenizer_resumed_from_prior_tokens_continues_the_same_text(tok):
    # NOTE: the way a decode worker takes a request over: every prior output id fed to a fresh detokenizer
    ids = tok.encode("Grüße aus Köln 😀 and 中文 text")
    whole = IncrementalDetokenizer(tok)
    expected = [whole.add(i) for i in ids]
    for cut in range(1, len(ids)):
        resumed = IncrementalDetokenizer(tok)
        for i in ids[:cut]:
            resumed.add(i)
        assert resumed.text == "".join(expected[:cut])
        assert [resumed.add(i) for i in ids[cut:]] == expected[cut:]
