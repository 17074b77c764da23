"""Turns API messages into what the workers run: checked token ids and SamplingParams.

Every check raises InvalidRequestError naming the field as the client spells it (`sampling.top_p`,
`messages[2].role`, ...); the gRPC layer maps it to INVALID_ARGUMENT in one place (router/errors.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message

from cluster.messages import WorkerInfo
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.v1 import inference_pb2 as pb

MAX_REQUEST_ID_CHARS = 256
MAX_PROMPT_CHARS = 1 << 20
MAX_MESSAGES = 1024
CHAT_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_MAX_TOKENS = 16  # as in vLLM and the OpenAI completions API


class Undecodable:
    """What a request's bytes became when they are not a valid message (e.g. invalid UTF-8 in a string field)."""

    def __init__(self, message_name: str, reason: str) -> None:
        self.message_name, self.reason = message_name, reason


def tolerant_parser(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    """A request deserializer that never raises: bad bytes become an Undecodable, rejected as INVALID_ARGUMENT.

    NOTE: gRPC answers a deserializer's exception with INTERNAL; a malformed request is the client's error.
    """
    def parse(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            return Undecodable(cls.DESCRIPTOR.full_name, str(e) or "cannot be parsed")
    return parse


def _decoded(req: Message | Undecodable) -> None:
    if isinstance(req, Undecodable):
        raise InvalidRequestError("request", f"is not a valid {req.message_name} ({req.reason}; strings must be "
                                  "UTF-8)")


@dataclass
class Checked:
    """A request ready to route."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams


class RequestValidator:
    """Checks requests against the model the workers serve (vocabulary, context length, chat template)."""

    def __init__(self, info: WorkerInfo) -> None:
        self.info = info
        self.tokenizer = Tokenizer.from_json(info.tokenizer_json)

    def generate(self, req: pb.GenerateRequest) -> Checked:
        _decoded(req)
        reject_unknown_fields(req)
        rid = self._request_id(req.request_id)
        if req.prompt and req.prompt_token_ids:
            raise InvalidRequestError("prompt_token_ids", "set either prompt or prompt_token_ids, not both", rid)
        if req.prompt:
            if len(req.prompt) > MAX_PROMPT_CHARS:
                raise InvalidRequestError("prompt", f"is longer than {MAX_PROMPT_CHARS} characters", rid)
            tokens, field = self.tokenizer.encode(req.prompt), "prompt"
        elif req.prompt_token_ids:
            tokens, field = list(req.prompt_token_ids), "prompt_token_ids"
            vocab = self.info.vocab_size
            bad = next((t for t in tokens if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(field, f"token id {bad} is not in the vocabulary [0, {vocab})", rid)
        else:
            raise InvalidRequestError("prompt", "must not be empty (set prompt or prompt_token_ids)", rid)
        return Checked(rid, self._check_length(tokens, field, rid), self.sampling(req.sampling, rid))

    def chat(self, req: pb.ChatRequest) -> Checked:
        _decoded(req)
        reject_unknown_fields(req)
        rid = self._request_id(req.request_id)
        if not req.messages:
            raise InvalidRequestError("messages", "must hold at least one message", rid)
        if len(req.messages) > MAX_MESSAGES:
            raise InvalidRequestError("messages", f"at most {MAX_MESSAGES} messages", rid)
        total = 0
        for i, m in enumerate(req.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, "
                                          f"got {m.role!r}", rid)
            total += len(m.content)
        if total > MAX_PROMPT_CHARS:
            raise InvalidRequestError("messages", f"contents are longer than {MAX_PROMPT_CHARS} characters", rid)
        try:
            text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in req.messages])
        except Exception as e:  # noqa: BLE001 - the model's own template may refuse a conversation (raise_exception)
            raise InvalidRequestError("messages", f"the chat template rejected them: {e}", rid) from None
        tokens = self._check_length(self.tokenizer.encode(text), "messages", rid)
        return Checked(rid, tokens, self.sampling(req.sampling, rid))

    def sampling(self, s: pb.SamplingParams, request_id: str) -> SamplingParams:
        """The proto's sampling fields as SamplingParams (unset optional fields take the defaults)."""
        max_tokens = s.max_tokens if s.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        if max_tokens > self.info.max_model_len:
            raise InvalidRequestError("sampling.max_tokens", f"must be at most {self.info.max_model_len} "
                                      "(the model's context length)", request_id)
        vocab = self.info.vocab_size
        bad = next((t for t in s.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise InvalidRequestError("sampling.stop_token_ids", f"token id {bad} is not in [0, {vocab})", request_id)
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=s.temperature if s.HasField("temperature") else 1.0,
                top_p=s.top_p if s.HasField("top_p") else 1.0, top_k=s.top_k,
                seed=s.seed if s.HasField("seed") else None, stop=list(s.stop),
                stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"sampling.{e.field}", e.reason.removeprefix(f"{e.field}: "),
                                      request_id) from None

    def _request_id(self, rid: str) -> str:
        if not rid:
            return f"req-{uuid.uuid4().hex}"
        if len(rid) > MAX_REQUEST_ID_CHARS or not rid.isprintable():
            raise InvalidRequestError("request_id", f"must be printable and at most {MAX_REQUEST_ID_CHARS} characters")
        return rid

    def _check_length(self, tokens: list[int], field: str, rid: str) -> list[int]:
        if not tokens:
            raise InvalidRequestError(field, "must not be empty", rid)
        limit = self.info.max_model_len - 1
        if len(tokens) > limit:
            raise InvalidRequestError(field, f"is {len(tokens)} tokens; the model takes at most {limit} "
                                      "(its context length minus one generated token)", rid)
        return tokens


def reject_unknown_fields(msg: Message, path: str = "") -> None:
    """Fields this server does not know (a newer client, a typo'd schema) are an error, not silently dropped."""
    unknown = list(unknown_fields.UnknownFieldSet(msg))
    if unknown:
        raise InvalidRequestError(f"{path or msg.DESCRIPTOR.name}", f"unknown field number {unknown[0].field_number} "
                                  f"(this server speaks {msg.DESCRIPTOR.full_name} of pdcluster.v1)")
    for fd, value in msg.ListFields():
        name = f"{path}.{fd.name}" if path else fd.name
        if fd.message_type is None:
            continue
        if fd.is_repeated:
            for i, item in enumerate(value):
                reject_unknown_fields(item, f"{name}[{i}]")
        else:
            reject_unknown_fields(value, name)
