"""Turns sampled tokens into user-visible output: incremental text, stop conditions, finish reasons."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


def stop_holdback(params: SamplingParams) -> int:
    """Characters of the generated text held back from the stream: as many as a stop string could still need.

    NOTE: so streamed text never contains (part of) a stop string that later matches. A decode worker that takes
    over a request after its first token computes what the prefill worker streamed with this same rule.
    """
    return max((len(s) for s in params.stop), default=1) - 1


@dataclass
class RequestOutput:
    """What one step produced for one request (`new_*`) and, once finished, the final result."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" (eos, stop token or stop string), "length" or "abort"
    token_ids: list[int] = field(default_factory=list)  # all generated tokens so far
    text: str = ""  # on finish: the whole generated text (stop string cut off)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # params.logprobs: one per new token
    # params.prompt_logprobs: one per prompt token (the first None), on the output of the first generated token
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class _Stream:
    __slots__ = ("detok", "emitted", "holdback")

    def __init__(self, detok: IncrementalDetokenizer, holdback: int) -> None:
        self.detok = detok
        self.emitted = 0  # characters of detok.text already returned
        self.holdback = holdback


class OutputProcessor:
    """Per-request detokenizer state and stop checks."""

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._streams: dict[str, _Stream] = {}

    def start(self, seq: Sequence, sent_chars: int = 0) -> None:
        """Track `seq`; `sent_chars`: characters of its output text (output tokens it arrived with) already sent.

        NOTE: one text contract across engines: a request taken over mid-way (the first token came from a prefill
        worker, or a failed decode worker streamed part of it) resumes the detokenizer from every output token so
        far and the emitted-text offset. Characters the previous engine held back for a stop string, a stop string
        straddling the take-over point and a character split across it then come out exactly as one engine's.
        """
        p = seq.params
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=p.skip_special_tokens)
        for tok in seq.output_token_ids:
            detok.add(tok)
        holdback = stop_holdback(p)
        stream = self._streams[seq.request_id] = _Stream(detok, holdback)
        stream.emitted = min(sent_chars, len(detok.text))

    def forget(self, seq: Sequence) -> None:
        self._streams.pop(seq.request_id, None)

    def append(self, seq: Sequence, tokens: list[int], accept: Callable[[Sequence, int], None]) -> RequestOutput:
        """Append a step's new tokens to `seq` one at a time through the stop checks (`accept`: the grammar's, per
        token); those after a stop are dropped. One output for them all."""
        outs = []
        for tok in tokens:
            seq.token_ids.append(tok)
            accept(seq, tok)
            outs.append(self.process(seq, tok))
            if outs[-1].finished:
                break
        if seq.new_logprobs:
            outs[0].new_logprobs, seq.new_logprobs = seq.new_logprobs, []
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == len(outs):  # the first output
            outs[0].prompt_logprobs = seq.prompt_logprobs or [None]
        if len(outs) == 1:
            return outs[0]
        last = outs[-1]
        return dataclasses.replace(last, new_token_ids=[t for o in outs for t in o.new_token_ids],
                                   new_text="".join(o.new_text for o in outs),
                                   new_logprobs=[lp for o in outs for lp in o.new_logprobs],
                                   prompt_logprobs=outs[0].prompt_logprobs)

    def process(self, seq: Sequence, token: int) -> RequestOutput:
        """Account for `token` (already appended to `seq`); decide whether the request is finished."""
        st = self._streams[seq.request_id]
        p = seq.params
        st.detok.add(token)
        text = st.detok.text
        reason, stop_at = None, -1
        if p.stop:
            search_from = max(0, st.emitted - max(len(s) for s in p.stop))
            hits = [i for i in (text.find(s, search_from) for s in p.stop) if i >= 0]
            if hits:
                reason, stop_at = "stop", min(hits)
        if reason is None:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                reason = "stop"
            elif seq.num_output_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
                reason = "length"
        if reason is None:
            visible = max(st.emitted, len(text) - st.holdback)
        else:
            # NOTE: flush emits a trailing incomplete character instead of dropping it.
            text = text[:stop_at] if stop_at >= 0 else text + st.detok.flush()
            visible = len(text)
            del self._streams[seq.request_id]
        new_text = text[st.emitted : visible] if visible > st.emitted else ""
        st.emitted = max(st.emitted, visible)
        seq.finish_reason = reason
        return RequestOutput(
            seq.request_id, [token], new_text, reason is not None, reason, seq.output_token_ids,
            text if reason is not None else "", seq.num_prompt_tokens, seq.num_cached_tokens)
