"""OpenAI request models (router/openai_models.py) → the router's plain requests, in the gRPC API's ranges.

NOTE: parsing and the neutral-value rule live in openai_models; here a validated value is carried in the range and
precision the gRPC API gives it, so the same request samples the same tokens over either front.
"""

from __future__ import annotations

import ctypes
from typing import Any

from engine.errors import InvalidRequestError
from engine.grammar import StructuredOutputSpec
from engine.sampling_params import MAX_LOGPROBS
from router.openai_models import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    SamplingBody,
    ToolBody,
    param_of,
)
from router.tool_calls import ToolCall, ToolFunction, ToolRequest
from router.validate import ChatTurn, SamplingFields

UINT32, UINT64 = 32, 64  # bits of the proto fields the gRPC API carries the same parameters in


def openai_param(field: str) -> str:
    """A validator field name as the OpenAI parameter the client set (`sampling.top_p` → `top_p`)."""
    field = field.removeprefix("sampling.")
    return {"prompt_token_ids": "prompt", "request_id": "X-Request-Id"}.get(field, field)

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


def sampling_fields(s: SamplingBody, max_tokens: int | None, limit_key: str = "max_tokens") -> SamplingFields:
    """The sampling fields of a validated body (vLLM's `top_k: -1` is top-k off)."""
    out = SamplingFields()
    if max_tokens is not None:
        out.max_tokens = unsigned(max_tokens, UINT32, limit_key)
    if s.temperature is not None:
        out.temperature = float32(s.temperature)
    if s.top_p is not None:
        out.top_p = float32(s.top_p)
    if s.top_k is not None:
        out.top_k = unsigned(0 if s.top_k == -1 else s.top_k, UINT32, "top_k")  # NOTE: -1 disables top-k (vLLM)
    if s.seed is not None:
        out.seed = unsigned(s.seed, UINT64, "seed")
    stop = [s.stop] if isinstance(s.stop, str) else s.stop or []
    out.stop = [utf8(x, "stop") for x in stop]
    out.stop_token_ids = unsigned_list(s.stop_token_ids or [], UINT32, "stop_token_ids")
    out.ignore_eos = bool(s.ignore_eos)
    _extras(s, out)
    spec = structured_spec(s)
    if spec is not None:
        out.structured, out.structured_field = spec
    return out


def _extras(s: SamplingBody, out: SamplingFields) -> None:
    """Penalties, min_p, logit_bias, n and logprobs (chat: `logprobs: true` + `top_logprobs`; completions: `logprobs:
    k`, with `echo` the prompt's too)."""
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        value = getattr(s, name)
        if value is not None:
            setattr(out, name, float32(value))
    if s.repetition_penalty is not None:
        out.repetition_penalty = float32(s.repetition_penalty)
    if s.n is not None:
        out.n = unsigned(s.n, UINT32, "n")
    for key, bias in (s.logit_bias or {}).items():
        if not key.isdigit():
            raise InvalidRequestError("logit_bias", f"keys must be token ids, got {key!r}")
        out.logit_bias[unsigned(int(key), UINT32, "logit_bias")] = float32(bias)
    if s.prompt_logprobs is not None:
        out.prompt_logprobs = unsigned(s.prompt_logprobs, UINT32, "prompt_logprobs")
    logprobs, top = getattr(s, "logprobs", None), getattr(s, "top_logprobs", None)
    if isinstance(logprobs, bool) or top is not None:  # a chat's
        if top is not None and not logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs: true")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise InvalidRequestError("top_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {top}")
        if logprobs:
            out.logprobs = top or 0
    elif logprobs is not None:  # a completion's: k alternatives
        out.logprobs = unsigned(logprobs, UINT32, "logprobs")
    out.echo = isinstance(s, CompletionRequest) and bool(s.echo)


# vLLM's `structured_outputs` keys taken at the value that matches what this server does, and the one that picks
# the output's form (exactly one of them).
_SO_NEUTRAL: dict[str, tuple[Any, ...]] = {"disable_fallback": (True, False), "disable_any_whitespace": (True,),
                                           "disable_additional_properties": (False,), "whitespace_pattern": (),
                                           "structural_tag": (), "backend": ()}
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_spec(body: Any) -> tuple[StructuredOutputSpec, str] | None:
    """The structured output a body asks for (`response_format`, vLLM's `structured_outputs` or its older
    `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`: one of them) and the parameter errors name.

    Only the request's shape is checked here; whether the schema, regex or grammar is valid is checked with the
    rest of the sampling fields (router/validate.py), off the event loop.
    """
    found: list[tuple[StructuredOutputSpec, str]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append((StructuredOutputSpec("json_object"), "response_format"))
        elif kind == "json_schema":
            inner = rf.get("json_schema")
            if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict | bool):
                raise InvalidRequestError("response_format.json_schema.schema", "must be a JSON schema object")
            found.append((StructuredOutputSpec.json_schema(inner["schema"]), "response_format.json_schema.schema"))
        elif kind != "text":
            raise InvalidRequestError("response_format.type", "must be 'text', 'json_object' or 'json_schema', got "
                                      f"{kind!r}")
    so = getattr(body, "structured_outputs", None)
    if so is not None:
        for key, value in so.items():
            if key in _SO_KINDS or value is None:
                continue
            if key not in _SO_NEUTRAL or not any(value == n and type(value) is type(n) for n in _SO_NEUTRAL[key]):
                raise InvalidRequestError(f"structured_outputs.{key}", "is not supported by this server")
        kinds = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequestError("structured_outputs", f"set exactly one of {', '.join(_SO_KINDS)}")
        param = f"structured_outputs.{kinds[0]}"
        found.append((_spec(kinds[0], so[kinds[0]], param), param))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}", None)
        if value is not None:
            found.append((_spec(key, value, f"guided_{key}"), f"guided_{key}"))
    if len(found) > 1:
        raise InvalidRequestError(found[1][1].split(".")[0], f"set one structured output only (also {found[0][1]})")
    return found[0] if found else None


def _spec(kind: str, value: Any, param: str) -> StructuredOutputSpec:
    if kind == "json":
        if not isinstance(value, dict | bool | str):
            raise InvalidRequestError(param, "must be a JSON schema (an object, or its JSON text)")
        return StructuredOutputSpec.json_schema(value)
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(param, "must be true")
        return StructuredOutputSpec("json_object")
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise InvalidRequestError(param, "must be a list of strings")
        return StructuredOutputSpec.choices([utf8(c, param) for c in value])
    if not isinstance(value, str):
        raise InvalidRequestError(param, "must be a string")
    return StructuredOutputSpec("regex" if kind == "regex" else "grammar", utf8(value, param))


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (a batch of one is taken), as text or token ids."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return utf8(prompt, "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return unsigned_list(prompt, UINT32, "prompt")
    raise InvalidRequestError("prompt", "must be a string or a list of token ids (one prompt per request)")


def chat_turns(messages: list[ChatMessage] | None) -> list[ChatTurn]:
    """OpenAI messages (content a string or a list of text parts, joined by newlines) as chat turns."""
    if messages is None:
        raise InvalidRequestError("messages", "must be a list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        content = m.content or ""
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(f"messages[{i}].content[{j}]", "only {\"type\": \"text\", \"text\": "
                                              "...} parts are supported")
                texts.append(part.text)
            content = "\n".join(texts)
        calls = [ToolCall(utf8(c.id, f"messages[{i}].tool_calls[{j}].id"),
                          utf8(c.function.name, f"messages[{i}].tool_calls[{j}].function.name"),
                          utf8(c.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"))
                 for j, c in enumerate(m.tool_calls or [])]
        out.append(ChatTurn(utf8(m.role, f"messages[{i}].role"), utf8(content, f"messages[{i}].content"), calls,
                            utf8(m.tool_call_id or "", f"messages[{i}].tool_call_id")))
    return out


def tool_request(body: ChatCompletionRequest) -> ToolRequest | None:
    """A chat body's `tools`, `tool_choice` and `parallel_tool_calls` (checked by router/tool_calls.py)."""
    return tools_of(body.tools, body.tool_choice, body.parallel_tool_calls)


def tools_of(body_tools: list[ToolBody] | None, choice: str | dict[str, Any] | None,
             parallel: bool | None = None) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` as a ToolRequest (None: neither tools nor a choice)."""
    if body_tools is None and choice is None:
        return None
    tools = []
    for i, t in enumerate(body_tools or []):
        if t.type != "function":
            raise InvalidRequestError(f"tools[{i}].type", f"only 'function' tools are supported, got {t.type!r}")
        f = t.function
        tools.append(ToolFunction(utf8(f.name, f"tools[{i}].function.name"), utf8(f.description or "",
                                  f"tools[{i}].function.description"), f.parameters, f"tools[{i}].function"))
    out = ToolRequest(tools, parallel=parallel is not False)
    if isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}}
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError("tool_choice", 'a named function is {"type": "function", "function": '
                                      '{"name": ...}}')
        out.choice, out.function = "function", name
    elif choice is not None:
        out.choice = choice
    return out


# ---- the same over plain dicts (used by tests and scripts that hold a body, not a model) ---------------------------
def sampling(body: dict[str, Any], max_tokens: int | None, limit_key: str = "max_tokens") -> SamplingFields:
    """The sampling fields of a body dict; the keys taken are removed from it."""
    taken = {k: body.pop(k) for k in list(body) if k in SamplingBody.model_fields}
    return sampling_fields(_validated(SamplingBody, taken), max_tokens, limit_key)


def chat_messages(raw: Any) -> list[ChatTurn]:
    """OpenAI messages (a JSON list) as chat turns."""
    if not isinstance(raw, list):
        raise InvalidRequestError("messages", "must be a list of {role, content} objects")
    return chat_turns([_validated(ChatMessage, m, f"messages[{i}]") for i, m in enumerate(raw)])


def _validated(kind: Any, value: Any, where: str = "") -> Any:
    from pydantic import ValidationError

    try:
        return kind.model_validate(value)
    except ValidationError as e:
        err = e.errors()[0]
        name = param_of(tuple(err["loc"]))
        field = f"{where}.{name}" if where and name != "body" else (where or name)
        raise InvalidRequestError(field, str(err["msg"])) from None
