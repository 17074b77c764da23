"""Logprobs in OpenAI's and vLLM's JSON shapes: chat's `logprobs.content`, completions' `tokens / token_logprobs /
top_logprobs / text_offset`, and vLLM's `prompt_logprobs` (one entry per prompt token, the first null)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.logprobs import TokenLogprobs
from engine.tokenizer import Tokenizer


class LogprobsFormatter:
    """Turns TokenLogprobs into JSON for one choice; keeps the completions text offset across chunks."""

    def __init__(self, tokenizer: Tokenizer, *, as_token_ids: bool = False, text_offset: int = 0) -> None:
        self.tokenizer = tokenizer
        self.as_token_ids = as_token_ids  # vLLM's return_tokens_as_token_ids: "token_id:<id>"
        self.text_offset = text_offset

    def token(self, token_id: int) -> str:
        """A token as logprobs name it: its own text (a partial character as U+FFFD, as vLLM shows it)."""
        if self.as_token_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat(self, entries: Sequence[TokenLogprobs]) -> dict[str, Any]:
        """`choices[].logprobs` of a chat completion (or of one streamed chunk)."""
        def one(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token(token_id)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}
        return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                            for e in entries]}

    def completion(self, entries: Sequence[TokenLogprobs | None], prompt_ids: Sequence[int] = ()) -> dict[str, Any]:
        """`choices[].logprobs` of a completion: per token its text, logprob, the top k (with it) and text offset.

        `entries` None stand for the first prompt token (no logprob); `prompt_ids` name their tokens.
        """
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, e in enumerate(entries):
            token_id = e.token_id if e is not None else prompt_ids[i]
            text = self.token(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
            if e is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(_finite(e.logprob))
            top = {self.token(t): _finite(v) for t, v in e.top}
            top.setdefault(text, _finite(e.logprob))  # NOTE: as vLLM: the chosen token is among them
            out["top_logprobs"].append(top)
        return out

    def prompt(self, entries: Sequence[TokenLogprobs | None]) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
        out: list[dict[str, Any] | None] = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            d = {str(t): {"logprob": _finite(v), "rank": r, "decoded_token": self.token(t)}
                 for r, (t, v) in enumerate(e.top, start=1)}
            d.setdefault(str(e.token_id), {"logprob": _finite(e.logprob), "rank": e.rank,
                                           "decoded_token": self.token(e.token_id)})
            out.append(d)
        return out


def _finite(value: float) -> float:
    """JSON has no -inf: a token a mask ruled out gets vLLM's stand-in, -9999.0."""
    return value if value > -9999.0 else -9999.0
