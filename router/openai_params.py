"""OpenAI request bodies → the router's proto requests: parameter by parameter, refusals naming the parameter.

NOTE: like vLLM, parameters this server does not implement are accepted only at their default value, and any key
left over after parsing is refused as unknown, so a typo never silently changes what a client gets.
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequestError
from router.v1 import inference_pb2 as pb

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


def set_field(msg: Any, name: str, value: Any, param: str) -> None:
    """Set a proto field, turning the proto's own range/type refusal into a 400 naming `param`."""
    try:
        if isinstance(value, list):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(param, f"out of range or of the wrong type ({e})") from None


def sampling(body: dict[str, Any], max_tokens: int | None, limit_key: str = "max_tokens") -> pb.SamplingParams:
    """The sampling parameters of a request body (vLLM's extensions `top_k` and `ignore_eos` included)."""
    s = pb.SamplingParams()
    if max_tokens is not None:
        set_field(s, "max_tokens", max_tokens, limit_key)
    for key in ("temperature", "top_p"):
        v = take(body, key, (int, float), "a number")
        if v is not None:
            set_field(s, key, float(v), key)
    top_k = take(body, "top_k", int, "an integer")
    if top_k is not None:
        set_field(s, "top_k", 0 if top_k == -1 else top_k, "top_k")  # NOTE: -1 disables top-k, as in vLLM
    seed = take(body, "seed", int, "an integer")
    if seed is not None:
        set_field(s, "seed", seed, "seed")
    stop = take(body, "stop", (str, list), "a string or a list of strings")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not all(isinstance(x, str) for x in stop):
        raise InvalidRequestError("stop", "must be a string or a list of strings")
    set_field(s, "stop", stop, "stop")
    ids = take(body, "stop_token_ids", list, "a list of token ids") or []
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError("stop_token_ids", "must be a list of integers")
    set_field(s, "stop_token_ids", ids, "stop_token_ids")
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


def chat_messages(raw: Any) -> list[pb.ChatMessage]:
    """OpenAI messages (content a string or a list of text parts, joined by newlines) as proto messages."""
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
        out.append(pb.ChatMessage(role=m["role"], content=content))
    return out
