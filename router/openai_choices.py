"""One choice of an OpenAI answer, built from the router's chunks: its text (a completion's `echo` first), finish
reason, logprobs and usage, as one JSON choice or as the streamed deltas."""

from __future__ import annotations

from typing import Any

from engine.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.openai_logprobs import LogprobsFormatter
from router.openai_params import prompt_of
from router.results import Chunk, ToolCallDelta, Usage
from router.tool_calls import ToolCall
from router.tool_stream import merge_calls


class ChoiceBuilder:
    """The state of one choice across its chunks."""

    def __init__(self, index: int, *, chat: bool, formatter: LogprobsFormatter | None, echo: str | None,
                 prompt_ids: list[int], logprobs: bool, prompt_logprobs: bool, token_ids: bool = False) -> None:
        self.index, self.chat, self.formatter = index, chat, formatter
        self.want_token_ids = token_ids  # vLLM's return_token_ids
        self.token_ids: list[int] = []
        self.want_logprobs = logprobs
        self.echo = echo  # a completion's echo: the prompt text, sent before the first chunk's text
        self.prompt_ids = prompt_ids
        self.want_prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs field was asked for
        self.text = ""
        self.entries: list[TokenLogprobs | None] = []
        self.prompt_entries: list[TokenLogprobs | None] | None = None
        self.finish_reason = ""
        self.usage: Usage | None = None
        self.last: Chunk | None = None
        self.calls: list[ToolCall] = []
        self._started = False

    def add(self, chunk: Chunk) -> None:
        """Take a chunk into the unary answer."""
        head = self._head(chunk)
        self.text += head + chunk.text
        self.token_ids += chunk.token_ids
        self.entries += chunk.logprobs
        merge_calls(self.calls, chunk.tool_calls)
        self._end(chunk)

    def delta(self, chunk: Chunk) -> dict[str, Any] | None:
        """The streamed choice of this chunk (None when it carries nothing to send)."""
        first = not self._started
        head = self._head(chunk)
        text = head + chunk.text
        self._end(chunk)
        ids = self.want_token_ids and bool(chunk.token_ids)  # NOTE: sent even when its text is held back
        if not (text or ids or chunk.finish_reason or chunk.logprobs or chunk.tool_calls
                or (first and self.want_prompt_logprobs)):
            return None
        if self.chat:
            out: dict[str, Any] = {"index": self.index, "delta": {"content": text} if text else {}}
            if chunk.tool_calls:
                out["delta"]["tool_calls"] = [call_delta(p) for p in chunk.tool_calls]
        else:
            out = {"index": self.index, "text": text}
        out["finish_reason"] = chunk.finish_reason or None
        out["logprobs"] = self._logprobs(self._echo_entries(first) + list(chunk.logprobs))
        if self.want_token_ids:
            out["token_ids"] = list(chunk.token_ids)
        if first and self.want_prompt_logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs()
        return out

    def choice(self) -> dict[str, Any]:
        """The unary choice."""
        out: dict[str, Any] = {"index": self.index, "finish_reason": self.finish_reason or None,
                               "logprobs": self._logprobs(self._echo_entries(True) + self.entries)}
        out.update({"message": self._message()} if self.chat else {"text": self.text})
        if self.want_token_ids:
            out["token_ids"] = self.token_ids
        if not self.chat and self.want_prompt_logprobs:
            out["prompt_logprobs"] = self.prompt_logprobs()
        return out

    def _message(self) -> dict[str, Any]:
        if not self.calls:
            return {"role": "assistant", "content": self.text}
        # NOTE: as OpenAI: content null when the answer is calls alone
        return {"role": "assistant", "content": self.text or None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.calls]}

    def prompt_logprobs(self) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs` of this choice (None if the workers sent none)."""
        if self.formatter is None or self.prompt_entries is None:
            return None
        return LogprobsFormatter(self.formatter.tokenizer, as_token_ids=self.formatter.as_token_ids).prompt(
            self.prompt_entries)

    def _head(self, chunk: Chunk) -> str:
        if chunk.prompt_logprobs is not None:
            self.prompt_entries = chunk.prompt_logprobs
        if self._started:
            return ""
        self._started = True
        return self.echo or ""

    def _echo_entries(self, first: bool) -> list[TokenLogprobs | None]:
        """With echo and logprobs: the prompt's entries go before the first output token's."""
        if not first or self.echo is None or not self.want_logprobs:
            return []
        return list(self.prompt_entries or [None] * len(self.prompt_ids))

    def _logprobs(self, entries: list[TokenLogprobs | None]) -> dict[str, Any] | None:
        if self.formatter is None or not self.want_logprobs:
            return None
        if self.chat:
            return self.formatter.chat([e for e in entries if e is not None])
        return self.formatter.completion(entries, self.prompt_ids)

    def _end(self, chunk: Chunk) -> None:
        if chunk.finish_reason:
            self.finish_reason, self.usage, self.last = chunk.finish_reason, chunk.usage, chunk


def total_usage(choices: list[ChoiceBuilder]) -> Usage:
    """Usage of all choices: the prompt counted once, the completions summed."""
    first = choices[0].usage or Usage()
    return Usage(first.prompt_tokens, sum((c.usage or Usage()).completion_tokens for c in choices),
                 first.cached_prompt_tokens)


def call_delta(p: ToolCallDelta) -> dict[str, Any]:
    """A streamed piece of a tool call in OpenAI's shape: index, id, type and name first, then arguments only."""
    if p.id:
        return {"index": p.index, "id": p.id, "type": "function",
                "function": {"name": p.name, "arguments": p.arguments}}
    return {"index": p.index, "function": {"arguments": p.arguments}}


def choice_builders(body: Any, params: SamplingParams, prompt_ids: list[int], chat: bool,
                    tokenizer: Tokenizer) -> list[ChoiceBuilder]:
    """One builder per choice: logprobs formatting, a completion's echo (the prompt text before the output)."""
    echo = None
    if not chat and body.echo:
        prompt = prompt_of(body)
        echo = prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=False)
    as_ids = bool(body.return_tokens_as_token_ids)
    wants = params.logprobs is not None or body.prompt_logprobs is not None
    return [ChoiceBuilder(i, chat=chat, echo=echo, prompt_ids=prompt_ids,
                          formatter=LogprobsFormatter(tokenizer, as_token_ids=as_ids) if wants else None,
                          logprobs=params.logprobs is not None, prompt_logprobs=body.prompt_logprobs is not None
                          and i == 0, token_ids=bool(body.return_token_ids))
            for i in range(params.n)]
