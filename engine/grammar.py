"""The grammar of a structured output: what the client asked for (`StructuredOutputSpec`), its check (a bad one
is a 400 naming the field), and one sequence's matcher state. The engine side is engine/structured_output.py.

NOTE: this module imports nothing of the engine's request types, so SamplingParams and Sequence can hold its types.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from engine.errors import InvalidRequestError

log = logging.getLogger(__name__)

SpecKind = Literal["json", "json_object", "regex", "choice", "grammar"]
SPEC_KINDS: tuple[SpecKind, ...] = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 1 << 16  # a schema, regex or grammar longer than this is refused
# NOTE: JSON is generated compact (xgrammar's any_whitespace=False: ", " and ": " separators, no newlines). With any
# whitespace allowed a small model can spend its whole max_tokens on blank lines inside an object.
ANY_WHITESPACE = False


@dataclass(frozen=True)
class StructuredOutputSpec:
    """What the output must follow: a JSON schema (as JSON text), any JSON object (`value` ""), a regex, the choices
    (as a JSON list of strings) or an EBNF grammar (xgrammar's dialect: GBNF with a `root` rule)."""

    kind: SpecKind
    value: str = ""

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutputSpec:
        """A JSON-schema spec from a schema given as parsed JSON (dict or bool) or as JSON text."""
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False))

    @classmethod
    def choices(cls, choices: Sequence[str]) -> StructuredOutputSpec:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))


_XGR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: ")  # xgrammar's "[06:28:10] /project/cpp/x.cc:83: " log prefix


def check_spec(spec: StructuredOutputSpec, field: str, request_id: str | None = None) -> None:
    """Raise InvalidRequestError naming `field` if the spec's grammar cannot be built (the router's check)."""
    error = check_spec_shape(spec) or _grammar_error(spec)
    if error is not None:
        raise InvalidRequestError(field, error, request_id)


def check_spec_shape(spec: object) -> str | None:
    """What is wrong with a spec's type, kind or size, without building its grammar (None: nothing).

    NOTE: SamplingParams checks only this: building the grammar first imports xgrammar (~1 s, it loads
    transformers), which an engine must not do on its loop thread; the router builds it (`check_spec`), and an
    engine's compile thread does, ending a request whose grammar does not build (engine/structured_output.py).
    """
    if not isinstance(spec, StructuredOutputSpec) or spec.kind not in SPEC_KINDS or not isinstance(spec.value, str):
        return f"must be a StructuredOutputSpec with kind one of {SPEC_KINDS}"
    if len(spec.value) > MAX_SPEC_CHARS:
        return f"is {len(spec.value)} characters; at most {MAX_SPEC_CHARS}"
    return None


@lru_cache(maxsize=1024)
def _grammar_error(spec: StructuredOutputSpec) -> str | None:
    try:
        build_grammar(spec)
    except ValueError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError (and its own types) for a bad input
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _XGR_PREFIX.sub("", first)
    return None


IMPORT_NICE = 10  # the import's thread yields the cores to the workers' start (Linux: a thread's own nice value)


def preload() -> threading.Thread:
    """Import xgrammar on a thread of its own (started now; returned for tests to join).

    NOTE: the router checks each request's grammar with xgrammar, which pulls in torch and transformers (1-3 s on 2
    cores). The router's process imports neither to start; `serve` calls this as the workers start and joins it
    before it serves, so neither a request with tools or a response format nor the GIL the import holds delays a
    request.
    """
    thread = threading.Thread(target=_import_xgrammar, daemon=True, name="xgrammar-import")
    thread.start()
    return thread


def _import_xgrammar() -> None:
    if sys.platform == "linux":  # NOTE: elsewhere PRIO_PROCESS of a thread id is not that thread alone
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IMPORT_NICE)
    try:
        importlib.import_module("xgrammar")
    except ImportError as e:  # NOTE: a request that asks for a grammar is then refused, naming its field
        log.info("structured outputs and tools are unavailable here: %s", e)


def build_grammar(spec: StructuredOutputSpec) -> Any:
    """The xgrammar Grammar of a spec (no vocabulary needed); ValueError or xgrammar's error when it is bad."""
    import xgrammar as xgr  # NOTE: imported on first use: it pulls in transformers (~1 s)

    if spec.kind == "json":
        try:
            json.loads(spec.value)
        except json.JSONDecodeError as e:
            raise ValueError(f"is not valid JSON: {e}") from None
        return xgr.Grammar.from_json_schema(spec.value, any_whitespace=ANY_WHITESPACE)
    if spec.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=ANY_WHITESPACE)
    if spec.kind == "regex":
        if not spec.value:
            raise ValueError("must not be empty")
        return xgr.Grammar.from_regex(spec.value)
    if spec.kind == "choice":
        choices = json.loads(spec.value)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("must be a non-empty list of non-empty strings")
        # NOTE: JSON string escapes are EBNF string escapes; each choice is one literal alternative of `root`.
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
    if not spec.value.strip():
        raise ValueError("must not be empty")
    return xgr.Grammar.from_ebnf(spec.value)



class GrammarState:
    """One sequence's grammar: its compile, then a matcher fed every output token of the sequence."""

    __slots__ = ("future", "matcher")

    def __init__(self, future: Future[Any]) -> None:
        self.future = future  # the compiled grammar (xgrammar CompiledGrammar), shared by every sequence of the spec
        self.matcher: Any = None  # xgrammar GrammarMatcher, once compiled

    def start(self, output_token_ids: Sequence[int]) -> bool:
        """Build the matcher and feed it the tokens already emitted; False if the grammar rejects one of them."""
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(self.future.result())
        return all(self.matcher.accept_token(t) for t in output_token_ids)

    def accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and bool(self.matcher.is_terminated())
