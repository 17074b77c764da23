"""Offline, in-process API in the spirit of vLLM/nano-vllm: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams

Message = dict[str, str]


@dataclass
class Completion:
    """The result of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    cached_prompt_tokens: int


class LLM:
    """A colocated engine (prefill and decode in this process) behind a batch `generate` call."""

    _ids = itertools.count()

    def __init__(self, model: str = "smollm2", *, progress: bool = False, **engine_kwargs: object) -> None:
        config = EngineConfig(**engine_kwargs)  # type: ignore[arg-type]
        self.engine = LLMEngine(load_model(model, progress=progress, device=config.device, dtype=config.dtype), config)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: Seq[str] | Seq[Seq[int]] | str,
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        """Run every prompt to completion in one continuous batch; results come back in prompt order (n > 1: each
        prompt's n choices in a row)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if isinstance(sampling_params, Seq):
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("sampling_params", f"{len(params)} given for {len(prompts)} prompts")
        seqs = []
        try:
            for prompt, p in zip(prompts, params):
                seqs.append(self.engine.add_request(f"llm-{next(self._ids)}", prompt, p))  # type: ignore[arg-type]
        except Exception:
            for s in seqs:  # NOTE: one bad prompt rejects the call, and leaves the engine as it was
                self.engine.abort_request(s.request_id)
            raise
        final = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        # NOTE: n > 1: a prompt's n choices in a row (request ids <id>, <id>-1, ...; choice i samples with seed + i)
        ids = [(s, rid) for s in seqs for rid in [s.request_id] + [f"{s.request_id}-{i}" for i in range(1, s.params.n)]]
        return [Completion(rid, s.token_ids[: s.num_prompt_tokens], final[rid].token_ids, final[rid].text,
                           final[rid].finish_reason or "", s.num_cached_tokens) for s, rid in ids]

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT adapter directory as `name` (needs max_loras > 0); requests choose it with
        SamplingParams(lora=name)."""
        self.engine.load_lora(name, path)

    def chat(self, conversations: Seq[Message] | Seq[Seq[Message]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        """Apply the model's chat template to each conversation and generate the assistant's reply."""
        convs: Seq[Seq[Message]] = (
            [conversations] if conversations and isinstance(conversations[0], dict) else conversations  # type: ignore[list-item, assignment]
        )
        prompts = [self.tokenizer.apply_chat_template(list(c)) for c in convs]
        return self.generate(prompts, sampling_params)
