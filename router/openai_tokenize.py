"""vLLM's `/tokenize` and `/detokenize`: the token ids a request's prompt (or chat messages, through the model's
chat template) becomes on this cluster, and the text of token ids, in vLLM's request and response shapes."""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from router.openai_models import ChatMessage, ToolBody, _Strict, param_of
from router.openai_params import chat_turns, tools_of, unsigned_list, utf8
from router.validate import MessagesRequest, RequestValidator

UINT32 = 32


class TokenizeRequest(_Strict):
    """`/tokenize`: a `prompt` (completions form) or `messages` (chat form)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolBody] | None = None  # chat form: rendered as a chat request's tools are
    add_special_tokens: bool | None = None  # completions form: default true (vLLM's)
    add_generation_prompt: bool | None = None  # chat form: only true (the inference endpoints' template)
    return_token_strs: bool | None = None


class DetokenizeRequest(_Strict):
    """`/detokenize`: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def parse_model(kind: type[_Strict], body: Any) -> Any:
    """`body` as a `kind` model; a 400 naming the first wrong field."""
    from pydantic import ValidationError

    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        err = max(e.errors(), key=lambda x: len(x["loc"]))
        raise InvalidRequestError(param_of(tuple(err["loc"])), str(err["msg"])) from None


def tokenize(validator: RequestValidator, req: TokenizeRequest) -> dict[str, Any]:
    """vLLM's TokenizeResponse: count, max_model_len, tokens and (asked for) token_strs."""
    tokenizer = validator.tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequestError("prompt", "set either prompt or messages")
    if req.messages is not None:
        if req.add_generation_prompt is False:
            raise InvalidRequestError("add_generation_prompt", "only true (the default) is supported")
        # NOTE: tool_choice "none": the tools are rendered (and checked), nothing is planned
        tools = tools_of(req.tools, "none") if req.tools else None
        tokens = validator.chat(MessagesRequest("tokenize", chat_turns(req.messages), tools=tools)).token_ids
    else:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        tokens = tokenizer.encode(utf8(req.prompt or "", "prompt"), add_special_tokens=add)
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": validator.info.max_model_len, "tokens": tokens,
                           "token_strs": None}
    if req.return_token_strs:
        out["token_strs"] = [tokenizer.id_to_token(t) for t in tokens]
    return out


def detokenize(validator: RequestValidator, req: DetokenizeRequest) -> dict[str, Any]:
    """vLLM's DetokenizeResponse: the text of the tokens (special tokens kept)."""
    tokens = unsigned_list(req.tokens, UINT32, "tokens")
    vocab = validator.info.vocab_size
    bad = next((t for t in tokens if t >= vocab), None)
    if bad is not None:
        raise InvalidRequestError("tokens", f"token id {bad} is not in the vocabulary [0, {vocab})")
    return {"prompt": validator.tokenizer.decode(tokens, skip_special_tokens=False)}
