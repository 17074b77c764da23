"""Tool calling: a chat's `tools`, `tool_choice` and `parallel_tool_calls` checked, and what they become.

1. both fronts build a `ToolRequest` (router/openai_params.py from JSON, router/grpc_requests.py from protobuf);
2. the validator (router/validate.py) calls `plan_tools`: every bad input is an InvalidRequestError naming its
   field (a `parameters` that is not a JSON schema, a tool_choice naming a function not in tools, tools together
   with a structured output, "auto" on a router without `router.tool_call_parser`);
3. `required` and a named function become a structured output (xgrammar, engine/structured_output.py), so the
   answer is always valid call(s) whose arguments follow the function's schema: "required" a JSON array of
   `{"name", "parameters"}` objects (one item without parallel_tool_calls), a named function its arguments alone;
4. the `ToolPlan` rides with the request; router/tool_stream.py reads the calls out of each choice's text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError
from engine.grammar import StructuredOutputSpec, check_spec
from router.tool_parsers import PARSERS, NamedParser, RequiredParser, ToolParser

TOOL_CHOICES = ("none", "auto", "required")  # or a named function
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # as OpenAI


@dataclass(slots=True)
class ToolFunction:
    """One function the model may call."""

    name: str
    description: str = ""
    parameters: Any = None  # a JSON schema (parsed), None: no arguments asked for
    field: str = "tools[0]"  # where the client set it: errors name `<field>.name`, `<field>.parameters`


@dataclass(slots=True)
class ToolCall:
    """A whole call: an assistant message's (sent back by the client) or an answer's."""

    id: str
    name: str
    arguments: str  # JSON text


@dataclass(slots=True)
class ToolRequest:
    """What a chat request says about tools."""

    tools: list[ToolFunction] = field(default_factory=list)
    choice: str = ""  # "", "none", "auto", "required" or "function" (then `function` names it); "": the default
    function: str = ""
    parallel: bool = True  # parallel_tool_calls (OpenAI's default: true)
    choice_field: str = "tool_choice"


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How an answer's calls are read out of its text: "auto" (with a parser), "required" or "function"."""

    mode: str
    parser: str = ""  # auto: a router.tool_call_parser name (router/tool_parsers.py)
    function: str = ""  # mode "function": its name
    parallel: bool = True

    def new_parser(self) -> ToolParser:
        """A parser for one choice's text."""
        if self.mode == "function":
            return NamedParser(self.function)
        if self.mode == "required":
            return RequiredParser()
        return PARSERS[self.parser]()


def plan_tools(req: ToolRequest | None, parser: str | None, structured_field: str | None,
               rid: str) -> tuple[ToolPlan | None, StructuredOutputSpec | None]:
    """The plan (None: the answer is plain text) and the grammar a forced choice adds; InvalidRequestError naming the
    field of anything wrong. `structured_field`: where the request set a structured output, if it did."""
    if req is None or (not req.tools and req.choice in ("", "none", "auto")):
        return None, None
    if len(req.tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"at most {MAX_TOOLS} tools (got {len(req.tools)})", rid)
    choice = req.choice or "auto"
    if choice not in (*TOOL_CHOICES, "function"):
        raise InvalidRequestError(req.choice_field, f"must be one of {', '.join(TOOL_CHOICES)} or a named function, "
                                  f"got {choice!r}", rid)
    if not req.tools:
        raise InvalidRequestError(req.choice_field, f"{_shown(req)} needs a non-empty tools list", rid)
    if structured_field is not None:
        raise InvalidRequestError(structured_field, "cannot be combined with tools (the calls' arguments are the "
                                  "structured output)", rid)
    seen: set[str] = set()
    for t in req.tools:
        _check_function(t, seen, rid)
    if choice == "none":
        return None, None
    if choice == "auto":
        if parser is None:
            raise InvalidRequestError(req.choice_field, "'auto' needs a tool-call parser: this server has no "
                                      "router.tool_call_parser (use 'required', a named function or 'none')", rid)
        return ToolPlan("auto", parser=parser, parallel=req.parallel), None
    if choice == "function":
        chosen = next((t for t in req.tools if t.name == req.function), None)
        if chosen is None:
            raise InvalidRequestError(req.choice_field, f"names the function {req.function!r}, which is not in tools "
                                      f"({', '.join(t.name for t in req.tools)})", rid)
        spec = StructuredOutputSpec.json_schema(_arguments_schema(chosen))
        check_spec(spec, f"{chosen.field}.parameters", rid)
        return ToolPlan("function", function=chosen.name, parallel=req.parallel), spec
    for t in req.tools:  # NOTE: each schema alone first, so a grammar that does not build names its tool
        check_spec(StructuredOutputSpec.json_schema(_arguments_schema(t)), f"{t.field}.parameters", rid)
    spec = StructuredOutputSpec.json_schema(required_schema(req.tools, req.parallel))
    check_spec(spec, "tools", rid)
    return ToolPlan("required", parallel=req.parallel), spec


def required_schema(tools: list[ToolFunction], parallel: bool) -> dict[str, Any]:
    """tool_choice "required": an array of calls, each a tool's name and arguments (vLLM's form)."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.name]},
                                               "parameters": _arguments_schema(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def template_tools(req: ToolRequest | None) -> list[dict[str, Any]] | None:
    """The tools as a chat template reads them (OpenAI's shape, as transformers passes them)."""
    if req is None or not req.tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": _arguments_schema(t)}} for t in req.tools]


def template_calls(calls: list[ToolCall], where: str, rid: str) -> list[dict[str, Any]]:
    """An assistant message's calls as a chat template reads them: arguments parsed (vLLM passes a dict)."""
    out = []
    for i, c in enumerate(calls):
        try:
            arguments = json.loads(c.arguments or "{}")
        except ValueError as e:
            raise InvalidRequestError(f"{where}[{i}].function.arguments", f"is not JSON: {e}", rid) from None
        out.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}})
    return out


def _arguments_schema(t: ToolFunction) -> Any:
    return t.parameters if t.parameters is not None else {"type": "object", "properties": {}}


def _check_function(t: ToolFunction, seen: set[str], rid: str) -> None:
    if not NAME_PATTERN.match(t.name):
        raise InvalidRequestError(f"{t.field}.name", "must be 1 to 64 letters, digits, underscores or dashes, got "
                                  f"{t.name[:80]!r}", rid)
    if t.name in seen:
        raise InvalidRequestError(f"{t.field}.name", f"{t.name!r} is named twice in tools", rid)
    seen.add(t.name)
    if t.parameters is None:
        return
    if not isinstance(t.parameters, dict):
        raise InvalidRequestError(f"{t.field}.parameters", "must be a JSON schema object", rid)
    import jsonschema  # NOTE: on first use (the router's threads): the import costs ~0.1 s

    try:
        jsonschema.validators.validator_for(t.parameters).check_schema(t.parameters)
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.path)) or "the schema"
        raise InvalidRequestError(f"{t.field}.parameters", f"is not a valid JSON schema ({where}: "
                                  f"{e.message[:200]})", rid) from None


def _shown(req: ToolRequest) -> str:
    return f"the function {req.function!r}" if req.choice == "function" else repr(req.choice)
