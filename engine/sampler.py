"""Token sampling as a pipeline over the batch's rows, on the logits' device.

logits [N, V] float32 → logit_bias → the allowed-token bitmask (structured outputs) → repetition / presence /
frequency penalties → logprobs → temperature → top-k / top-p / min-p → sample (greedy rows: argmax).

Logprobs are vLLM v1's "processed logprobs": the log-softmax of the logits after logit_bias, the bitmask and the
penalties, before temperature and the filters (without those settings they equal the model's raw logprobs).
Nothing here reads a value back to the host: the caller turns the returned tensors into lists once per step.

NOTE: the random stream of a request is a pure function of (seed, output index), not a stateful generator,
so a request sampled partly on a prefill worker and partly on a decode worker draws the same tokens as one
that ran in a single engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


class SamplingRow(Protocol):
    """What the sampler reads of one row's request (engine.sequence.Sequence is one)."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far (the penalties' history)
    num_prompt_tokens: int

    @property
    def num_output_tokens(self) -> int: ...


@dataclass(slots=True)
class SamplerOutput:
    """The sampled tokens and, when a row asked, logprobs; all tensors on the logits' device."""

    token_ids: torch.Tensor  # [N] int64
    # [N, 1 + K]: column 0 the sampled token, then the K most likely (K = the largest `logprobs` of the rows; a row
    # that asked for fewer reads its first 1 + k columns). None when no row asked.
    logprobs: torch.Tensor | None = None  # float32
    logprob_token_ids: torch.Tensor | None = None  # int64


def step_seed(seed: int, index: int) -> int:
    """Seed of the draw for output token `index` of a request seeded with `seed`."""
    return (seed * 6364136223846793005 + (index + 1) * 1442695040888963407) & _MASK64


# NOTE: top-p looks for its cut among the top 256 tokens first (torch.topk, ~0.1 ms over a 49k vocabulary on one
# core), then among the top 4,096 (~0.5 ms), and sorts the whole vocabulary (~3.4 ms) only when they hold less than
# top_p of the mass (a flat distribution). The rule is the same. On an accelerator the whole vocabulary is sorted
# (no read-back of the candidates' mass).
TOP_P_CANDIDATES = (256, 4096)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Disallowed tokens to -inf. bitmask: int32 [N, ceil(V / 32)] in xgrammar's layout (bit set = allowed)."""
    n, v = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    allowed = bits.reshape(n, -1)[:, :v].bool()  # [N, V]
    return logits.masked_fill(~allowed, float("-inf"))


def _on(device: torch.device, values: list[Any], dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list as a tensor on `device`, without waiting for the work queued there.

    NOTE: `torch.tensor(values, device=cuda)` is a blocking copy: it waits for the whole stream, which on a graphed
    decode step includes the lookahead step queued behind it (model_runner.py). So is a copy from pageable memory
    (CUDA may sync to stage it); from pinned memory it is queued, and torch's pinned allocator keeps the buffer
    until the copy has run.
    """
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _history(rows: Sequence[SamplingRow], pick: list[int], v: int, device: torch.device,
             prompt_too: bool) -> torch.Tensor:
    """Counts [M, V] of each picked row's output tokens (with `prompt_too`, of prompt + output)."""
    seqs = [r.token_ids if prompt_too else r.token_ids[r.num_prompt_tokens :] for r in (rows[i] for i in pick)]
    width = max((len(s) for s in seqs), default=0)
    padded = _on(device, [[*s, *([v] * (width - len(s)))] for s in seqs], torch.long).reshape(len(pick), width)
    counts = torch.zeros(len(pick), v + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :v]


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """vLLM's penalties on the rows that set one (others untouched)."""
    pick = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not pick:
        return logits
    n, v = logits.shape
    dev = logits.device
    idx = _on(dev, pick)
    x = logits[idx]  # [M, V]
    params = [rows[i].params for i in pick]
    out_counts = _history(rows, pick, v, dev, prompt_too=False)  # [M, V]
    rep = _on(dev, [p.repetition_penalty for p in params]).unsqueeze(1)  # [M, 1]
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _history(rows, pick, v, dev, prompt_too=True) > 0  # prompt or output
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    freq = _on(dev, [p.frequency_penalty for p in params]).unsqueeze(1)
    pres = _on(dev, [p.presence_penalty for p in params]).unsqueeze(1)
    x = x - freq * out_counts - pres * (out_counts > 0).float()
    return logits.index_copy(0, idx, x)


def _apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    pick = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items() if t < logits.shape[1]]
    if not pick:
        return logits
    dev = logits.device
    r_idx, t_idx = _on(dev, [i for i, _, _ in pick]), _on(dev, [t for _, t, _ in pick])
    bias = _on(dev, [b for _, _, b in pick], logits.dtype)
    return logits.index_put((r_idx, t_idx), bias, accumulate=True)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:  # [V] → [V]
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs = logits.softmax(-1)  # [V]
        found = False
        if logits.device.type == "cpu":
            for k in TOP_P_CANDIDATES:
                top, order = torch.topk(probs, min(k, probs.shape[-1]))  # descending
                cum = top.cumsum(-1)
                if float(cum[-1]) >= top_p or len(top) == probs.shape[-1]:
                    found = True
                    break
        if not found:  # the cut lies further down (or no read-back wanted): every token counts
            sorted_logits, order = torch.sort(logits, descending=True)
            top = sorted_logits.softmax(-1)
            cum = top.cumsum(-1)
        # Drop a token once the mass before it already reaches top_p (the top token always stays); tokens beyond
        # the candidates are dropped (the mass before them is at least cum[-1] >= top_p).
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(0, order, (cum - top) < top_p)
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:  # [V] → [V]
    """The distribution a non-greedy request samples from: temperature, then top-k, top-p and min-p."""
    probs = _filter_top_k_top_p(logits / p.temperature, p.top_k, p.top_p).softmax(-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 1 + k] logprobs and ids: the token of each row, then the row's k most likely."""
    lp = logits.log_softmax(-1)  # [N, V]
    chosen = lp.gather(1, tokens.unsqueeze(1))  # [N, 1]
    if k == 0:
        return chosen, tokens.unsqueeze(1)
    top, ids = lp.topk(k, dim=-1)  # [N, k]
    return torch.cat([chosen, top], 1), torch.cat([tokens.unsqueeze(1), ids], 1)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: torch.Tensor | None = None) -> SamplerOutput:
    """One token per row of `logits` [N, V] (float32) with that row's settings and history.

    `bitmask`: int32 [N, ceil(V / 32)], bit set = allowed (xgrammar's layout); rows without a grammar all ones.
    Row i's draw uses its request's random stream at output index `rows[i].num_output_tokens + output_offset`.
    """
    x = _apply_logit_bias(logits, rows)
    if bitmask is not None:
        x = apply_token_bitmask(x, bitmask)
    x = _apply_penalties(x, rows)
    tokens = x.argmax(dim=-1)  # [N] greedy rows keep this
    want = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    for i, r in enumerate(rows):
        p = r.params
        if p.greedy:
            continue
        probs = filtered_probs(x[i], p)
        seed = step_seed(p.seed or 0, r.num_output_tokens + p.output_offset)
        gen = torch.Generator(device=x.device).manual_seed(seed)
        tokens[i] = race(probs, gen)
    if not want:
        return SamplerOutput(tokens)
    lp, ids = _logprobs(x, tokens, max(want))
    return SamplerOutput(tokens, lp, ids)


def race(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:  # probs: [V] → 0-d int64
    """Exponential-race sampling: argmax(p / E), E ~ Exp(1) drawn from `gen`, is index i with probability p_i.

    NOTE: E = -log(U), U uniform in [0, 1): torch.rand + log is ~5x faster than Tensor.exponential_ on CPU (0.19 vs
    0.93 ms over a 49k vocabulary, per sampled row per step). U = 0 gives E = inf and p / E = 0, never NaN.
    """
    noise = torch.rand(probs.shape, generator=gen, device=probs.device).log_().neg_()
    return (probs / noise).argmax()
