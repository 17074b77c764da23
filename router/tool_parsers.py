"""Tool calls read out of a model's text as it streams: vLLM's `tool_call_parser` formats, and the forms the
tool-choice grammars force (router/tool_calls.py).

Every parser takes text deltas (`feed`) and, at the end, `finish`; each returns the content delta (text that is not
a call) and the calls' pieces (`ToolCallDelta`: id and name first, then the arguments' JSON text as it arrives).
1. `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text;
2. `llama3_json`: an answer that starts with a JSON object (after an optional `<|python_tag|>`) is one or more
   `{"name": ..., "parameters": {...}}` objects separated by `;`; any other answer is content;
3. `RequiredParser`: tool_choice "required", a JSON array `[{"name": ..., "parameters": {...}}, ...]`;
4. `NamedParser`: a named function, whose whole output is its arguments.
A call object that turns out not to be one (bad JSON, no name) before its name was sent goes back to the content.
"""

from __future__ import annotations

from typing import Protocol

from router.results import ToolCallDelta
from router.tool_scanner import CallScanner, new_call_id

PYTHON_TAG = "<|python_tag|>"


class ToolParser(Protocol):
    """Text deltas in, (content delta, call pieces) out."""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]: ...

    def finish(self) -> tuple[str, list[ToolCallDelta]]: ...


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (kept back until the next delta)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _Calls:
    """What the parsers share: the pending text, the call being read, the calls so far."""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        raise NotImplementedError

    def __init__(self) -> None:
        self.buf = ""
        self.scanner: CallScanner | None = None
        self.raw = ""  # the current call's text so far (content again if it is not a call)
        self.calls = 0
        self.trim = False  # after a call: whitespace before the next text is dropped

    def text(self, content: str) -> str:
        if self.trim:
            content = content.lstrip()
            self.trim = not content
        return content

    def scan(self) -> tuple[str, list[ToolCallDelta]]:
        """Feed the pending text to the current call; content when it turned out not to be one."""
        assert self.scanner is not None
        used, pieces = self.scanner.feed(self.buf)
        self.raw += self.buf[:used]
        self.buf = self.buf[used:]
        if self.scanner.failed:
            back = "" if self.scanner.started else self.raw
            self.scanner = None
            return back, pieces
        if self.scanner.done:
            self.calls += 1
            self.scanner, self.trim = None, True
        return "", pieces

    def rest(self) -> str:
        """At the end: the text of a call never named, and what is pending."""
        back = self.raw if self.scanner is not None and not self.scanner.started else ""
        self.scanner = None
        out, self.buf = back + self.buf, ""
        return self.text(out)


class HermesParser(_Calls):
    """`<tool_call>{...}</tool_call>` blocks (Hermes, Qwen 2.5, the template shipped for SmolLM2)."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content, pieces = "", list[ToolCallDelta]()
        while True:
            if self.scanner is None:
                if self.calls and not self._skip_close():
                    break
                at = self.buf.find(self.OPEN)
                if at < 0:
                    keep = _held(self.buf, self.OPEN)
                    content += self.text(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content += self.text(self.buf[:at])
                self.buf, self.raw = self.buf[at + len(self.OPEN):], self.OPEN
                self.scanner = CallScanner(self.calls)
            back, more = self.scan()
            content, pieces = content + back, pieces + more
            if self.scanner is not None:
                break
        return content, pieces

    def _skip_close(self) -> bool:
        """After a call: drop its `</tool_call>`; False while the text may still be one."""
        head = self.buf.lstrip()
        if head.startswith(self.CLOSE):
            self.buf = head[len(self.CLOSE):]
        elif self.CLOSE.startswith(head):
            return False
        return True

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        rest = self.buf.lstrip()
        if self.calls and self.scanner is None and self.CLOSE.startswith(rest) and (not rest or rest[:2] == "</"):
            self.buf = ""  # NOTE: the last call's unfinished close tag (a lone "<" is text)
        return self.rest(), []


class Llama3JsonParser(_Calls):
    """An answer that is `{"name": ..., "parameters": {...}}` objects separated by `;` (Llama 3.1's JSON format)."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = False  # the answer is not calls: everything is content

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content, pieces = "", list[ToolCallDelta]()
        while not self.plain:
            if self.scanner is None:
                head = self.buf.lstrip(" \t\r\n;" if self.calls else " \t\r\n")
                if not self.calls and PYTHON_TAG.startswith(head[:len(PYTHON_TAG)]) and head:
                    if len(head) < len(PYTHON_TAG):
                        return content, pieces  # NOTE: maybe the tag: wait for more
                    head = head[len(PYTHON_TAG):].lstrip()
                if not head:
                    return content, pieces
                if head[0] != "{":
                    self.plain = True
                    break
                self.buf, self.raw = head, ""
                self.scanner = CallScanner(self.calls)
            back, more = self.scan()
            pieces += more
            if back:  # NOTE: not a call after all: the answer is content from here
                self.buf, self.plain = back + self.buf, True
            if self.scanner is not None:
                return content, pieces
        content += self.text(self.buf)
        self.buf = ""
        return content, pieces

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.rest(), []


class RequiredParser(_Calls):
    """tool_choice "required": the grammar's JSON array of `{"name": ..., "parameters": {...}}` objects."""

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        pieces: list[ToolCallDelta] = []
        while True:
            if self.scanner is None:
                at = self.buf.find("{")
                if at < 0:
                    self.buf = ""
                    break
                self.buf = self.buf[at:]
                self.scanner = CallScanner(self.calls)
            _, more = self.scan()
            pieces += more
            if self.scanner is not None:
                break
        return "", pieces

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return "", []


class NamedParser:
    """A named function's call: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        self.name, self.started = name, False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if not self.started:
            self.started = True
            return "", [ToolCallDelta(0, new_call_id(), self.name, text)]
        return "", [ToolCallDelta(0, arguments=text)] if text else []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self.feed("") if not self.started else ("", [])


# router.tool_call_parser names (vLLM's)
PARSERS: dict[str, type[_Calls]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}
