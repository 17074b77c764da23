"""InputProcessor: a request's prompt and params checked and turned into the Sequence(s) the scheduler queues.

What `LLMEngine.add_request` takes apart before anything is queued (vLLM's input processor): the prompt as text or
ids, checked against the vocabulary and the context length; the params' own checks and those that need the model
(stop token ids); a resumed request's output (a decode failover); and, for `n` > 1, the other choices, each with
its own seed, which fork from the request once its prompt is computed (`LLMEngine._fork`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer


class InputProcessor:
    """Checks and tokenizes requests for one engine (its vocabulary, context length, block size and cache scope)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, block_size: int,
                 scope: str) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.block_size, self.scope = block_size, scope

    def sequences(self, request_id: str, prompt: str | Seq[int], params: SamplingParams, lora_key: str,
                  output_token_ids: Seq[int] = ()) -> tuple[Sequence, list[Sequence]]:
        """The request's Sequence and, with `n` > 1, its other choices; InvalidRequestError naming the bad field."""
        token_ids = self.tokenize(prompt, request_id)
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", f"ids must be in [0, {self.vocab_size})", request_id)
        if output_token_ids:
            self.tokenize([*token_ids, *output_token_ids], request_id)  # the same vocabulary and length checks
            if len(output_token_ids) >= params.max_tokens:
                raise InvalidRequestError("output_token_ids", f"holds {len(output_token_ids)} tokens: nothing is "
                                          f"left of max_tokens={params.max_tokens}", request_id)
        if params.n > 1 and output_token_ids:
            raise InvalidRequestError("n", "a resumed request continues one choice (n = 1)", request_id)
        seq = Sequence(request_id, token_ids, params, self.block_size, self.scope, lora_key)
        seq.token_ids.extend(output_token_ids)  # NOTE: like a preempted sequence: output kept, KV recomputed
        forks = [Sequence(f"{request_id}-{i}", token_ids, dataclasses.replace(
                     params, n=1, seed=((params.seed or 0) + i) % 2**64, prompt_logprobs=None),
                     self.block_size, self.scope, lora_key) for i in range(1, params.n)]
        return seq, forks

    def tokenize(self, prompt: str | Seq[int], request_id: str | None = None) -> list[int]:
        """Token ids of a prompt (text or ids), checked against the vocabulary and the context length."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty", request_id)
            token_ids = self.tokenizer.encode(prompt)
            field = "prompt"
        else:
            try:
                token_ids = list(prompt)  # type: ignore[arg-type]  # a non-iterable raises TypeError, mapped below
            except TypeError:
                raise InvalidRequestError("prompt", "must be a string or a list of token ids, got "
                                          f"{type(prompt).__name__}", request_id) from None
            field = "prompt_token_ids"
            vocab = self.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
                raise InvalidRequestError(field, f"token ids must be integers in [0, {vocab})", request_id)
        if not token_ids:
            raise InvalidRequestError(field, "must not be empty", request_id)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                field, f"is {len(token_ids)} tokens; this engine takes at most {self.max_model_len - 1} "
                "(max_model_len minus one generated token)", request_id)
        return token_ids
