"""Quality of a quantized engine against a float32 one: teacher-forced top-1 agreement and perplexity.

Both figures feed the reference's tokens through the engine under test in block-sized chunks, so every chunk after
the first attends to the KV *as the cache stores it* (dequantized int8 KV included), as decoding does.
1. `top1_agreement`: the float32 engine generates greedily; the engine under test predicts each of those tokens
   from the same prefix; the figure is the share of positions whose argmax equals the reference's token;
2. `perplexity`: exp of the mean negative log-likelihood of a fixed text, each token given the ones before it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq

import torch

from engine.attention import AttentionMetadata
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


@torch.inference_mode()
def sequence_logits(engine: LLMEngine, token_ids: Seq[int]) -> torch.Tensor:  # → [T, vocab] float32
    """Logits after every token of `token_ids`, computed chunk by chunk over scratch blocks of `engine` (idle)."""
    if engine.config.tensor_parallel_size > 1:  # NOTE: it runs the model outside a step: the followers would not join
        raise InvalidRequestError("tensor_parallel_size", "quality figures read one process's model: use TP 1")
    bs, runner = engine.config.block_size, engine.runner
    seq = Sequence("quality-scratch", list(token_ids), SamplingParams(temperature=0.0), bs, engine.scope)
    if not engine.block_manager.allocate(seq, len(seq)):
        raise RuntimeError(f"{len(seq)} tokens do not fit in the engine's free KV blocks")
    out = []
    try:
        for start in range(0, len(seq), bs):
            n = min(bs, len(seq) - start)
            meta = AttentionMetadata.build([seq.block_table], [start], [n], bs, kernel=runner.attn_kernel,
                                           backend=runner.attn_backend, device=runner.device)
            ids, pos = runner.to_device(seq.token_ids[start : start + n], list(range(start, start + n)))
            hidden = runner.model(ids, pos, runner.kv_caches, meta)
            out.append(runner.model.logits(hidden).float())
    finally:
        engine.block_manager.free(seq)  # never registered: nothing stays cached
    return torch.cat(out)


def greedy_outputs(engine: LLMEngine, prompts: Seq[Seq[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations (ignoring EOS) of every prompt, in one batch."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(f"quality-{i}", list(p), params).request_id for i, p in enumerate(prompts)]
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o.token_ids
    return [final[i] for i in ids]


def top1_agreement(engine: LLMEngine, prompts: Seq[Seq[int]], references: Seq[Seq[int]]) -> float:
    """Share of reference tokens that `engine` also ranks first given the same prefix (teacher-forced)."""
    hits = total = 0
    for prompt, ref in zip(prompts, references):
        logits = sequence_logits(engine, [*prompt, *ref])
        predicted = logits[len(prompt) - 1 : len(prompt) - 1 + len(ref)].argmax(-1).tolist()
        hits += sum(p == r for p, r in zip(predicted, ref))
        total += len(ref)
    return hits / max(total, 1)


def perplexity(engine: LLMEngine, token_ids: Seq[int]) -> float:
    """exp(mean NLL) of tokens 1.. of `token_ids` under `engine`."""
    logits = sequence_logits(engine, token_ids)[:-1]  # [T - 1, vocab]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(list(token_ids[1:]), device=logits.device))
    return math.exp(float(nll))
