"""OpenAI request bodies as pydantic models, taken the way vLLM takes them.

1. a known field of the wrong JSON type is a 400 naming it (`temperature`, `messages[1].role`);
2. a field this server does not know is accepted and ignored, with one warning per field name (and a count in
   `pdcluster_openai_ignored_fields_total`), as vLLM does: clients built on LangChain, LiteLLM or the OpenAI SDK
   send fields of their own;
3. a known field this server does not implement is accepted only at its neutral value (the value that changes
   nothing: `repetition_penalty: 1.0`, `min_p: 0`, `top_k: -1`, ...); any other value is a 400 naming it, so a
   client never silently gets an answer other than the one it asked for.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from engine.errors import InvalidRequestError

log = logging.getLogger(__name__)
MAX_WARNED_FIELDS = 256  # distinct ignored names remembered (and metric labels); more are counted as "other"
MAX_FIELD_LABEL_CHARS = 64  # a longer unknown field name is counted as "other"
_TYPE_TAGS = ("str", "int", "float", "bool", "none", "dict", "list")


class _Strict(BaseModel):
    # NOTE: strict: "5" is not an integer and true is not a number, as in the proto the gRPC API carries them in
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    """`stream_options`: usage in a last chunk; vLLM's `continuous_usage_stats` only at false."""

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class ContentPart(_Strict):
    """One part of a message's content; only text parts are supported."""

    type: str
    text: str | None = None


class FunctionBody(_Strict):
    """A tool's function: its name, description and arguments' JSON schema (`strict` accepted: always enforced)."""

    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class ToolBody(_Strict):
    """One entry of `tools` (only function tools)."""

    type: str
    function: FunctionBody


class CalledFunction(_Strict):
    """The function of an assistant message's tool call: its name and arguments (JSON text)."""

    name: str
    arguments: str


class ToolCallBody(_Strict):
    """A tool call in an assistant message the client sends back."""

    id: str
    type: str = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    """One chat message: an assistant's may hold `tool_calls`, a tool message answers `tool_call_id`."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None
    tool_call_id: str | None = None


class SamplingBody(_Strict):
    """The sampling fields both APIs share (vLLM's `top_k`, `ignore_eos`, `stop_token_ids` included)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None  # carried to the workers' detokenizers
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key: a string) → bias
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs with the top k


class _Common(SamplingBody):
    """What completions and chat requests share."""

    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    user: str | None = None  # NOTE: accepted and ignored, as OpenAI and vLLM do (it only tags the request)
    request_id: str | None = None  # vLLM's body field; the X-Request-Id header wins
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>"
    return_token_ids: bool | None = None  # vLLM's: each choice (and each streamed chunk) carries its token ids
    # Accepted at their neutral value only (NEUTRAL below)
    min_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    priority: int | None = None


class CompletionRequest(_Common):
    """A `/v1/completions` body."""

    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = None


class ChatCompletionRequest(_Common):
    """A `/v1/chat/completions` body."""

    messages: list[ChatMessage] | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolBody] | None = None  # router/tool_calls.py
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[Any] | None = None


# The values of unimplemented fields that change nothing (absent, null, or one of these); anything else is a 400.
# NOTE: served since issue 28 (no longer here): n, the penalties, min_p, logit_bias, logprobs, top_logprobs,
# prompt_logprobs, return_tokens_as_token_ids and a completion's echo.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_tokens": (0,), "response_format": ({"type": "text"},),
    "spaces_between_special_tokens": (True,), "include_stop_str_in_output": (False,), "use_beam_search": (False,),
    "length_penalty": (1,), "truncate_prompt_tokens": (), "allowed_token_ids": (),
    "bad_words": ([],), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "priority": (0,),
    "echo": (False,), "best_of": (1,), "suffix": ("",),
    "add_generation_prompt": (True,),
    "continue_final_message": (False,), "chat_template": (), "chat_template_kwargs": ({},), "documents": ([],),
}
# Structured outputs are served (router/openai_params.py `structured_spec`): these are no longer refused.
for _served in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs"):
    del NEUTRAL[_served]
# NOTE: a chat's add_special_tokens defaults to False and a completion's to True (vLLM's defaults)
ADD_SPECIAL_TOKENS: dict[type[BaseModel], bool] = {CompletionRequest: True, ChatCompletionRequest: False}


def param_of(loc: tuple[str | int, ...]) -> str:
    """A pydantic error location as the parameter a client spelled (`messages[1].content[0].type`)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.lower() in _TYPE_TAGS or "[" in part or "-" in part:
            continue  # the member of a union pydantic tried, not a key of the body
        else:
            out += f".{part}" if out else part
    return out or "body"


def parse(kind: type[_Common], body: Any) -> Any:
    """`body` (parsed JSON) as a `kind` model; a 400 naming the first wrong field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    try:
        req = kind.model_validate(body)
    except ValidationError as e:
        # NOTE: a union reports one error per member; the deepest location names the exact wrong item
        err = max(e.errors(), key=lambda x: len(x["loc"]))
        raise InvalidRequestError(param_of(tuple(err["loc"])), f"{err['msg']} (got {_short(err.get('input'))})") \
            from None
    refuse_non_neutral(req)
    return req


def refuse_non_neutral(req: BaseModel) -> None:
    """A 400 naming the first field set to something this server does not implement."""
    for name, neutral in NEUTRAL.items():
        if isinstance(req, CompletionRequest) and name == "echo":
            continue  # NOTE: a completion's echo is served (the prompt before the output); a chat's is not
        if name == "best_of" and getattr(req, "best_of", None) == (getattr(req, "n", None) or 1):
            continue  # NOTE: best_of = n changes nothing (vLLM's default)
        v = getattr(req, name, None)
        if v is None or any(_same(v, n) for n in neutral):
            continue
        raise InvalidRequestError(name, f"is not supported by this server (only {_neutral_text(neutral)} is "
                                  "accepted; it changes nothing)")
    add, default = getattr(req, "add_special_tokens", None), ADD_SPECIAL_TOKENS.get(type(req))
    if add is not None and add != default:
        raise InvalidRequestError("add_special_tokens", f"only {default} (the default) is supported")
    options = getattr(req, "stream_options", None)
    if options is not None and options.continuous_usage_stats:
        raise InvalidRequestError("stream_options.continuous_usage_stats", "only false is supported")


def ignored_fields(req: BaseModel) -> list[str]:
    """The names of the fields of `req` (and of its messages) this server does not know, e.g. `messages.foo`."""
    names = list(req.model_extra or {})
    options = getattr(req, "stream_options", None)
    if options is not None:
        names += [f"stream_options.{k}" for k in options.model_extra or {}]
    for m in getattr(req, "messages", None) or []:
        names += [f"messages.{k}" for k in m.model_extra or {}]
        if isinstance(m.content, list):
            names += [f"messages.content.{k}" for part in m.content for k in part.model_extra or {}]
    return sorted(set(names))


class IgnoredFieldLog:
    """Logs each ignored field name once per process and names the metric label it is counted under."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def note(self, name: str) -> str:
        """The metric label of `name` (capped at MAX_WARNED_FIELDS names); warns the first time it is seen."""
        if len(name) > MAX_FIELD_LABEL_CHARS:  # NOTE: a label is kept forever: a megabyte name is not one
            return "other"
        with self._lock:
            if name in self._seen:
                return name
            if len(self._seen) >= MAX_WARNED_FIELDS:
                return "other"
            self._seen.add(name)
        log.warning("ignoring the request field %r: this server does not know it (warned once per field name)",
                    name[:64])
        return name


def _same(value: Any, neutral: Any) -> bool:
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


def _neutral_text(neutral: tuple[Any, ...]) -> str:
    return " or ".join(["null", *(repr(n) for n in neutral)])


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."
