"""One tool call's JSON object read a character at a time, as a model writes it: `{"name": ..., "arguments":
{...}}` (or "parameters", Llama 3's key; keys in any order). The name is sent once it is whole, the arguments' text
in pieces as it arrives; an object that is not a call (bad JSON, no name) is `failed`, and its parser gives the text
back as content (router/tool_parsers.py).
"""

from __future__ import annotations

import json
import uuid

from router.results import ToolCallDelta

ARGUMENT_KEYS = ("arguments", "parameters")  # hermes writes "arguments", llama 3 "parameters"


def new_call_id() -> str:
    """A tool call id in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


class CallScanner:
    """One call object read a character at a time: its name sent once whole, its arguments' text as it comes."""

    def __init__(self, index: int) -> None:
        self.index, self.id = index, new_call_id()
        self.name: str | None = None
        self.started = False  # the first piece (id, name) was sent
        self.done = self.failed = False
        self._state = "open"
        self._key = self._raw_key = self._value = ""
        self._depth = 0  # nesting inside the current value
        self._in_string = self._escape = False
        self._args_seen = False
        self._streaming = False  # the current value is the arguments object, sent as it comes
        self._out = ""  # argument text not sent yet

    def feed(self, text: str) -> tuple[int, list[ToolCallDelta]]:
        """Read `text` up to the object's end; the characters read and the pieces now known."""
        used = 0
        for c in text:
            if self.done or self.failed:
                break
            if not self._step(c):  # NOTE: a scalar value ends at the character after it: read that one again
                self._step(c)
            used += 1
        return used, self._pieces()

    def _step(self, c: str) -> bool:
        """Take one character; False when it ended a scalar value and must be read again."""
        s = self._state
        if s in ("open", "key_or_end", "colon", "value", "after") and c.isspace():
            return True
        if s == "open":
            self._to("key_or_end" if c == "{" else "failed")
        elif s == "key_or_end":
            if c == '"':
                self._raw_key, self._state = "", "key"
            elif c == "}":
                self._end()
            else:
                self._to("failed")
        elif s == "key":
            if self._escape or c not in '"\\':
                self._raw_key, self._escape = self._raw_key + c, False
            elif c == "\\":
                self._raw_key, self._escape = self._raw_key + c, True
            else:
                key = _loads(f'"{self._raw_key}"')
                self._key, self._state = key if isinstance(key, str) else "", "colon"
        elif s == "colon":
            self._to("value" if c == ":" else "failed")
        elif s == "value":
            self._value, self._depth, self._in_string = c, 1, c == '"'
            self._streaming = self._key in ARGUMENT_KEYS and not self._args_seen and c in "{["
            self._out += c if self._streaming else ""
            self._state = "nested" if c in "{[" else "string" if c == '"' else "scalar"
        elif s in ("nested", "string"):
            self._value += c
            self._out += c if self._streaming else ""
            if self._escape:
                self._escape = False
            elif c == "\\" and (self._in_string or s == "string"):
                self._escape = True
            elif c == '"':
                self._in_string = not self._in_string
                if s == "string":
                    self._value_end()
            elif not self._in_string and c in "{[":
                self._depth += 1
            elif not self._in_string and c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._value_end()
        elif s == "scalar":
            if c in ",}" or c.isspace():
                self._value_end()
                return False
            self._value += c
        elif s == "after":
            if c == ",":
                self._state = "key_or_end"
            elif c == "}":
                self._end()
            else:
                self._to("failed")
        return True

    def _to(self, state: str) -> None:
        self._state = state
        self.failed = state == "failed"

    def _value_end(self) -> None:
        self._state = "after"
        if self._key == "name":
            name = _loads(self._value)
            if not isinstance(name, str) or not name:
                self._to("failed")
            else:
                self.name = name
        elif self._key in ARGUMENT_KEYS and not self._args_seen:
            self._args_seen = True
            if not self._streaming:  # NOTE: arguments given as a JSON string (or a scalar): sent decoded, whole
                value = _loads(self._value)
                self._out += value if isinstance(value, str) else self._value
        self._streaming = False

    def _end(self) -> None:
        if self.name is None:
            self._to("failed")
            return
        self.done = True
        if not self._args_seen:
            self._out += "{}"

    def _pieces(self) -> list[ToolCallDelta]:
        if self.failed or self.name is None:
            return []
        if not self.started:
            self.started = True
            out, self._out = self._out, ""
            return [ToolCallDelta(self.index, self.id, self.name, out)]
        if self._out:
            out, self._out = self._out, ""
            return [ToolCallDelta(self.index, arguments=out)]
        return []


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None
