"""gRPC requests → the router's plain requests (router/validate.py): bytes that never fail to parse, unknown fields
refused, optional fields kept apart from their defaults.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message

from engine.errors import InvalidRequestError
from engine.grammar import StructuredOutputSpec
from router.lora import Adapters
from router.tool_calls import ToolCall, ToolFunction, ToolRequest
from router.v1 import inference_pb2 as pb
from router.validate import (
    MAX_MESSAGES,
    ChatTurn,
    Checked,
    MessagesRequest,
    PromptRequest,
    RequestValidator,
    SamplingFields,
    checks_on_loop,
)


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


def reject_unknown_fields(msg: Message, path: str = "") -> None:
    """Fields this server does not know (a newer client, a typo'd schema) are an error, not silently dropped."""
    unknown = list(unknown_fields.UnknownFieldSet(msg))
    if unknown:
        raise InvalidRequestError(f"{path or msg.DESCRIPTOR.name}", f"unknown field number {unknown[0].field_number} "
                                  f"(this server speaks {msg.DESCRIPTOR.full_name} of pdcluster.v1)")
    for fd, value in msg.ListFields():
        name = f"{path}.{fd.name}" if path else fd.name
        if fd.message_type is None or fd.message_type.GetOptions().map_entry:
            continue  # NOTE: a map's entries (logit_bias) are scalars: nothing below them to check
        if fd.is_repeated:
            for i, item in enumerate(value):
                reject_unknown_fields(item, f"{name}[{i}]")
        else:
            reject_unknown_fields(value, name)


def sampling_fields(s: pb.SamplingParams) -> SamplingFields:
    """The proto's sampling fields; an unset optional field stays None."""
    out = SamplingFields(
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else None, stop=list(s.stop), stop_token_ids=list(s.stop_token_ids),
        ignore_eos=s.ignore_eos, presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else None, min_p=s.min_p,
        logit_bias=dict(s.logit_bias), logprobs=s.logprobs if s.HasField("logprobs") else None,
        prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None, n=s.n or 1)
    if s.HasField("structured_output"):
        out.structured, out.structured_field = structured_output(s.structured_output)
    return out


def structured_output(so: pb.StructuredOutput) -> tuple[StructuredOutputSpec, str]:
    """The spec of a StructuredOutput message (exactly one field set) and the field it names in errors."""
    names = [f.name for f, _ in so.ListFields()]
    if len(names) != 1:
        raise InvalidRequestError("sampling.structured_output", "set exactly one of json_schema, json_object, regex, "
                                  f"choice, grammar (got {', '.join(names) or 'none'})")
    name = names[0]
    field = f"sampling.structured_output.{name}"
    if name == "json_schema":
        return StructuredOutputSpec("json", so.json_schema), field
    if name == "json_object":
        return StructuredOutputSpec("json_object"), field
    if name == "choice":
        return StructuredOutputSpec.choices(list(so.choice)), field
    return StructuredOutputSpec(name, getattr(so, name)), field  # type: ignore[arg-type]  # regex or grammar


class ProtoValidator:
    """Checks the Inference service's requests: parse errors and unknown fields first, then RequestValidator."""

    def __init__(self, validator: RequestValidator,
                 adapter: Callable[[str, str | None], str | None] | None = None) -> None:
        self.validator = validator
        # NOTE: `model` → the LoRA adapter it names (None: the base model), ModelNotFound for an unknown one
        self.adapter = adapter or Adapters({}).resolve_base_only

    def precheck(self, req: Message | Undecodable) -> None:
        """The size limits on counts alone (no tokenizing): before the request takes an admission slot."""
        if isinstance(req, pb.GenerateRequest):
            self.validator.precheck(len(req.prompt), len(req.prompt_token_ids), 0, len(req.sampling.stop_token_ids),
                                    req.request_id)
        elif isinstance(req, pb.ChatRequest):
            self.validator.precheck(sum(len(m.content) for m in req.messages[:MAX_MESSAGES + 1]), 0,
                                    len(req.messages), len(req.sampling.stop_token_ids), req.request_id)

    @staticmethod
    def on_loop(req: Message | Undecodable) -> bool:
        """Whether the request's check is small enough for the event loop (router/validate.py: `checks_on_loop`)."""
        if isinstance(req, pb.GenerateRequest):
            return checks_on_loop(len(req.prompt), len(req.prompt_token_ids),
                                  structured=req.sampling.HasField("structured_output"))
        if isinstance(req, pb.ChatRequest):
            return checks_on_loop(sum(len(m.content) for m in req.messages[:MAX_MESSAGES + 1]),
                                  structured=req.sampling.HasField("structured_output"), tools=len(req.tools) > 0)
        return True  # NOTE: undecodable: its check only raises

    def generate(self, req: pb.GenerateRequest | Undecodable) -> Checked:
        _decoded(req)
        assert isinstance(req, pb.GenerateRequest)
        reject_unknown_fields(req)
        lora = self.adapter(req.model, req.request_id or None)
        checked = self.validator.prompt(PromptRequest(req.request_id, req.prompt, list(req.prompt_token_ids),
                                                      sampling_fields(req.sampling)))
        checked.params.lora = lora
        return checked

    def chat(self, req: pb.ChatRequest | Undecodable) -> Checked:
        _decoded(req)
        assert isinstance(req, pb.ChatRequest)
        reject_unknown_fields(req)
        lora = self.adapter(req.model, req.request_id or None)
        # NOTE: one past the limit is enough for the validator to refuse; a 16 MiB request holds millions
        turns = [ChatTurn(m.role, m.content, [ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls],
                          m.tool_call_id) for m in req.messages[:MAX_MESSAGES + 1]]
        checked = self.validator.chat(MessagesRequest(req.request_id, turns, sampling_fields(req.sampling),
                                                      tool_request(req)))
        checked.params.lora = lora
        return checked


def tool_request(req: pb.ChatRequest) -> ToolRequest | None:
    """A ChatRequest's tools, tool_choice and parallel_tool_calls (checked by router/tool_calls.py)."""
    if not req.tools and not req.HasField("tool_choice"):
        return None
    tools = []
    for i, t in enumerate(req.tools):
        try:
            parameters = json.loads(t.parameters) if t.parameters else None
        except ValueError as e:
            raise InvalidRequestError(f"tools[{i}].parameters", f"is not JSON: {e}") from None
        tools.append(ToolFunction(t.name, t.description, parameters, f"tools[{i}]"))
    out = ToolRequest(tools, parallel=req.parallel_tool_calls if req.HasField("parallel_tool_calls") else True)
    which = req.tool_choice.WhichOneof("choice")
    if which is not None:
        out.choice_field = f"tool_choice.{which}"
    if which == "function":
        out.choice, out.function = "function", req.tool_choice.function
    elif which == "mode":
        out.choice = req.tool_choice.mode or "auto"
    return out
