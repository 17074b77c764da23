"""Text <-> token ids and the chat template, built from the model's own files (GGUF metadata or tokenizer.json)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import gguf
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.decoders import DecodeStream

from engine.errors import ModelLoadError

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes of the llama.cpp `tokenizer.ggml.pre` names we support, applied before byte-level encoding.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# NOTE: these use GPT-2's own split regex (ByteLevel use_regex=True); "smollm" first splits digits one by one,
# as SmolLM's tokenizer.json does.
_GPT2_PRES = ("default", "gpt2", "smollm")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the alphabet byte-level vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2_PRES:
        return byte_level
    supported = sorted([*_SPLITS, *_GPT2_PRES])
    raise ModelLoadError("model", f"unsupported tokenizer.ggml.pre {pre!r}; supported: {supported}")


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _token_content(value: Any) -> str | None:
    # NOTE: tokenizer_config.json writes a special token as a string or as a serialized AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _compile_template(source: str) -> jinja2.Template:
    # NOTE: the same environment transformers renders chat templates in, so prompts match token for token.
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids plus the model's chat template, built from the model's own files."""

    def __init__(self, backend: _Backend, *, bos_token_id: int | None, eos_token_id: int | None, add_bos: bool,
                 chat_template: str | None) -> None:
        self._backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self._template: jinja2.Template | None = None

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Byte-level BPE from the tokenizer.ggml.* fields of a GGUF file."""
        kind, pre = _field(reader, "tokenizer.ggml.model"), _field(reader, "tokenizer.ggml.pre") or "default"
        if kind != "gpt2":
            raise ModelLoadError("model", f"unsupported tokenizer.ggml.model {kind!r}; only byte-level BPE ('gpt2')")
        tokens: list[str] = _field(reader, "tokenizer.ggml.tokens") or []
        if not tokens:
            raise ModelLoadError("model", "the GGUF file has no tokenizer.ggml.tokens")
        merges: list[str] = _field(reader, "tokenizer.ggml.merges") or []
        types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ModelLoadError("model", f"{len(tokens)} tokens but {len(types)} token types in the GGUF file")
        kinds = list(zip(tokens, types, strict=True))
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # NOTE: a token written outside the byte alphabet is raw text; respell it the way the merges see it.
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i for i, t in enumerate(tokens)}
        pairs = [(a, b) for a, _, b in (m.partition(" ") for m in merges)]
        backend = _Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        # NOTE: control tokens (<|im_start|>, ...) must match whole and be skippable on decode, so they become
        # special added tokens; a "control" token outside the byte alphabet is a llama.cpp mislabel and is skipped.
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds
                                    if k == _CONTROL and set(t) <= alphabet])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds
                            if k == _USER_DEFINED and t in vocab])
        bos, eos = _field(reader, "tokenizer.ggml.bos_token_id"), _field(reader, "tokenizer.ggml.eos_token_id")
        return cls(backend, bos_token_id=None if bos is None else int(bos),
                   eos_token_id=None if eos is None else int(eos),
                   add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token")),
                   chat_template=_field(reader, "tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str) -> Tokenizer:
        """tokenizer.json plus tokenizer_config.json (chat template, bos/eos, add_bos_token) of an HF directory."""
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ModelLoadError("model", f"no tokenizer.json in {path}")
        try:
            backend = _Backend.from_file(tok_file)
        except Exception as e:  # tokenizers raises a bare Exception on a malformed file
            raise ModelLoadError("model", f"cannot read {tok_file}: {e}") from e
        cfg: dict[str, Any] = {}
        if os.path.isfile(cfg_file := os.path.join(path, "tokenizer_config.json")):
            with open(cfg_file, encoding="utf-8") as f:
                cfg = json.load(f)
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if os.path.isfile(jinja_file := os.path.join(path, "chat_template.jinja")):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        bos_tok, eos_tok = _token_content(cfg.get("bos_token")), _token_content(cfg.get("eos_token"))
        bos = backend.token_to_id(bos_tok) if bos_tok else None
        eos = backend.token_to_id(eos_tok) if eos_tok else None
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            # NOTE: many tokenizer.json files add BOS in their post-processor instead of saying add_bos_token.
            add_bos = bos is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos]
        return cls(backend, bos_token_id=bos, eos_token_id=eos, add_bos=bool(add_bos), chat_template=template)

    def to_json(self) -> str:
        """Everything needed to rebuild this tokenizer, as one JSON string (see from_json)."""
        return json.dumps({"tokenizer": self._backend.to_str(), "bos_token_id": self.bos_token_id,
                           "eos_token_id": self.eos_token_id, "add_bos": self.add_bos,
                           "chat_template": self.chat_template})

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        """The tokenizer to_json wrote."""
        d = json.loads(text)
        return cls(_Backend.from_str(d["tokenizer"]), bos_token_id=d["bos_token_id"], eos_token_id=d["eos_token_id"],
                   add_bos=d["add_bos"], chat_template=d["chat_template"])

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; prepends BOS only if the model wants it and add_special_tokens is set."""
        # NOTE: the backend's own post-processor is bypassed so that BOS handling is the same for every source.
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def max_token_chars(self) -> int | None:
        """The most characters of text one token stands for; None when a normalizer may shrink the text first.

        NOTE: a bound for refusing a prompt before tokenizing it: a text of more than n x this many characters is
        more than n tokens (byte-level BPE: a token is at most this many bytes, a character at least one).
        """
        if self._backend.normalizer is not None:
            return None
        return max((len(t) for t in self._backend.get_vocab(with_added_tokens=True)), default=None)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 becomes '\\ufffd'."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary entry (e.g. '<|im_end|>'), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary entry of an id as the vocabulary spells it, or None."""
        return self._backend.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        """Whether the id is a special (control) token, skipped by decode(skip_special_tokens=True)."""
        return token_id in self._special

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render a conversation (and the tools it may call, OpenAI's shape) with the chat template, as transformers
        does (tokenize=False)."""
        if self.chat_template is None:
            raise ModelLoadError("chat_template", "the model's files carry no chat template; send a raw prompt")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        special = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id}
        names = {k: self._backend.id_to_token(v) for k, v in special.items() if v is not None}
        return self._template.render(messages=[dict(m) for m in messages], tools=tools, documents=None,
                                     add_generation_prompt=add_generation_prompt, **names)

    def save_hf(self, path: str) -> None:
        """Write tokenizer.json and tokenizer_config.json so that from_hf_dir (and transformers) read it back."""
        os.makedirs(path, exist_ok=True)
        self._backend.save(os.path.join(path, "tokenizer.json"))
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos,
                               "clean_up_tokenization_spaces": False}
        for key, token_id in (("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)):
            if token_id is not None:
                cfg[key] = self._backend.id_to_token(token_id)
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(cfg, f, ensure_ascii=False, indent=2)


class IncrementalDetokenizer:
    """Turns generated ids, fed one at a time, into text deltas that never split a UTF-8 character."""

    # NOTE: `tokenizers`' own DecodeStream (Rust, the prefix/read-offset scheme vLLM uses) does the work: it decodes
    # a short window before each new token and diffs it, so decoders that strip or merge at token boundaries stay
    # correct, and it returns None while the text would end inside a multi-byte character ('\ufffd').

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self.text = ""
        self._emitted = 0  # ids whose text is in `text`; the rest are held back (an incomplete character)

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes ('' while a character is still incomplete)."""
        self.ids.append(token_id)
        delta = self._stream.step(self._tokenizer._backend, token_id)
        if not delta:
            return ""
        self._emitted = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (as '\ufffd' if incomplete) at the end of generation."""
        if self._emitted == len(self.ids):
            return ""
        # NOTE: decoded after the last emitted token, as the stream would, so a boundary space is kept
        context = self.ids[max(0, self._emitted - 1):self._emitted]
        full = self._tokenizer.decode(context + self.ids[self._emitted:], self._skip)
        base = self._tokenizer.decode(context, self._skip)
        delta = full[len(base):] if full.startswith(base) else self._tokenizer.decode(self.ids[self._emitted:],
                                                                                       self._skip)
        self._emitted = len(self.ids)
        self._stream = DecodeStream(skip_special_tokens=self._skip)  # NOTE: held-back ids are spent
        self.text += delta
        return delta
