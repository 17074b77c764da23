"""OpenAI request bodies → the router's plain requests: parameter by parameter, refusals naming the parameter.

NOTE: like vLLM, parameters this server does not implement are accepted only at their default value, and any key
left over after parsing is refused as unknown, so a typo never silently changes what a client gets.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any

from engine.errors import InvalidRequestError
from router.validate import ChatTurn, SamplingFields

UINT32, UINT64 = 32, 64  # bits of the proto fields the gRPC API carries the same parameters in

# Parameters accepted only at their default value (None = absent); anything else is a 400 naming them.
UNSUPPORTED_COMPLETION = {"logprobs": None, "echo": False, "best_of": 1, "presence_penalty": 0,
                          "frequency_penalty": 0, "logit_bias": None, "suffix": None}
UNSUPPORTED_CHAT = {"logprobs": False, "top_logprobs": 0, "presence_penalty": 0, "frequency_penalty": 0,
                    "logit_bias": None, "tools": None, "tool_choice": None, "response_format": None}

def openai_param(field: str) -> str:
    """A validator field name as the OpenAI parameter the client set (`sampling.top_p` → `top_p`)."""
    field = field.removeprefix("sampling.")
    return "prompt" if field == "prompt_token_ids" else field


def take(body: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """Pop `key` from the body (None when absent or null), refusing a value of the wrong JSON type."""
    v = body.pop(key, None)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if v is not None and (not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds)):
        raise InvalidRequestError(key, f"must be {what}, got {json.dumps(v)[:64]}")
    return v


# NOTE: an HTTP request carries each parameter in the range and precision the gRPC API gives it, so the same
# request samples the same tokens over either front, and a value the proto could not hold is refused alike.
def unsigned(value: int, bits: int, param: str) -> int:
    """`value` if an unsigned integer of `bits` holds it, else a 400 naming `param`."""
    if not 0 <= value < 1 << bits:
        raise InvalidRequestError(param, f"out of range or of the wrong type (Value out of range: {value})")
    return value


def unsigned_list(values: list[int], bits: int, param: str) -> list[int]:
    """Every value `unsigned`, else a 400 naming `param`."""
    return [unsigned(v, bits, param) for v in values]


def float32(value: float) -> float:
    """`value` rounded to the proto's 32-bit float, as a gRPC request carries it (too large → ±inf)."""
    return float(ctypes.c_float(value).value)


def utf8(text: str, param: str) -> str:
    """`text` if it encodes as UTF-8 (JSON may carry a lone surrogate, which no proto string holds), else a 400."""
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise InvalidRequestError(param, f"out of range or of the wrong type ({e})") from None
    return text


def sampling(body: dict[str, Any], max_tokens: int | None, limit_key: str = "max_tokens") -> SamplingFields:
    """The sampling parameters of a request body (vLLM's extensions `top_k` and `ignore_eos` included)."""
    s = SamplingFields()
    if max_tokens is not None:
        s.max_tokens = unsigned(max_tokens, UINT32, limit_key)
    temperature = take(body, "temperature", (int, float), "a number")
    if temperature is not None:
        s.temperature = float32(temperature)
    top_p = take(body, "top_p", (int, float), "a number")
    if top_p is not None:
        s.top_p = float32(top_p)
    top_k = take(body, "top_k", int, "an integer")
    if top_k is not None:
        s.top_k = unsigned(0 if top_k == -1 else top_k, UINT32, "top_k")  # NOTE: -1 disables top-k, as in vLLM
    seed = take(body, "seed", int, "an integer")
    if seed is not None:
        s.seed = unsigned(seed, UINT64, "seed")
    stop = take(body, "stop", (str, list), "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not all(isinstance(x, str) for x in stop):
        raise InvalidRequestError("stop", "must be a string or a list of strings")
    s.stop = [utf8(x, "stop") for x in stop]
    ids = take(body, "stop_token_ids", list, "a list of token ids") or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError("stop_token_ids", "must be a list of integers")
    s.stop_token_ids = unsigned_list(ids, UINT32, "stop_token_ids")
    s.ignore_eos = bool(take(body, "ignore_eos", bool, "true or false"))
    return s


def finish_body(body: dict[str, Any], defaults: dict[str, Any]) -> None:
    """Refuse unsupported parameters set to anything but their default, and any key left over (unknown)."""
    if take(body, "n", int, "an integer") not in (None, 1):
        raise InvalidRequestError("n", "only n=1 is supported (one choice per request)")
    body.pop("user", None)
    for key, default in defaults.items():
        v = body.pop(key, None)
        if v is not None and not (isinstance(v, bool) == isinstance(default, bool) and v == default):
            raise InvalidRequestError(key, "is not supported by this server (leave it unset)")
    if body:
        raise InvalidRequestError(next(iter(body)), "unknown parameter")


def chat_messages(raw: Any) -> list[ChatTurn]:
    """OpenAI messages (content a string or a list of text parts, joined by newlines) as chat turns."""
    if not isinstance(raw, list):
        raise InvalidRequestError("messages", "must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(f"messages[{i}]", "must be an object with a string role")
        extra = set(m) - {"role", "content", "name"}
        if extra:
            raise InvalidRequestError(f"messages[{i}].{sorted(extra)[0]}", "unknown or unsupported key")
        content = m.get("content") or ""
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequestError(f"messages[{i}].content[{j}]", "only {\"type\": \"text\", \"text\": "
                                              "...} parts are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content", "must be a string or a list of text parts")
        out.append(ChatTurn(utf8(m["role"], f"messages[{i}].role"), utf8(content, f"messages[{i}].content")))
    return out
