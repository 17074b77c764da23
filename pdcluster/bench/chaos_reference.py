"""The text one engine gives, for `bench chaos`: a greedy reference per finished request, up to near ties.

1. `compute`: one in-process engine runs every finished request's prompt greedily (`ignore_eos`, its max_tokens),
   all in one continuous batch;
2. `near_ties`: greedy outputs are not batch-invariant (on the CPU, the matmul's blocking and the reduction order
   follow the batch), so where the top two tokens tie to float rounding a request served beside other requests can
   take the other one, and go on from there. Seen in chaos runs: one request of ~2,800, whose top two tokens at its
   16th token were 3.8e-06 apart (this check's figure, BENCHMARKS.md "Chaos"). A request whose output differs from
   the reference is fed back to the engine (its prompt and its own output as one prompt, with prompt logprobs): it
   passes only when each of its tokens is the engine's most likely there or within `NEAR_TIE` of it, the rule the
   correctness tests apply against transformers (tests/test_correctness.py). An HTTP client gets text only: its
   text is encoded back to ids, which must decode to exactly that text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdcluster.bench.chaos_check import Record, Reference
from pdcluster.bench.report import log

if TYPE_CHECKING:
    from engine import LLM
    from engine.logprobs import TokenLogprobs

NEAR_TIE = 1e-3  # logprob gap to the most likely token that still counts as a tie (rounding, not a different model)


def compute(model: str, records: list[Record]) -> tuple[Reference, LLM | None]:
    """(ids, text) one in-process engine gives, greedy, for each finished request's prompt; and that engine."""
    from engine import LLM, SamplingParams

    todo = sorted({(tuple(r.prompt), r.max_tokens) for r in records if r.status == "OK"})
    if not todo:
        return {}, None
    log("chaos", f"computing the reference of {len(todo)} requests with one in-process engine")
    llm = LLM(model)
    out = llm.generate([list(p) for p, _ in todo],
                       [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in todo])
    return {key: (list(c.token_ids), c.text) for key, c in zip(todo, out)}, llm


def near_ties(llm: LLM, wrong: list[Record], reference: Reference) -> dict[int, str]:
    """Of the finished requests whose output differs from the reference, those whose every token is the engine's
    greedy choice up to a near tie, given the tokens before it: request index → where it left the reference."""
    ties: dict[int, str] = {}
    for r in wrong:
        ids = r.token_ids if r.token_ids is not None else llm.tokenizer.encode(r.text, add_special_tokens=False)
        if not ids or (r.token_ids is None and llm.tokenizer.decode(ids) != r.text):
            continue
        scored = _scored(llm, r.prompt, ids)
        gaps = [max(0.0, lp.top[0][1] - lp.logprob) if lp is not None and lp.top else float("inf") for lp in scored]
        if len(gaps) != len(ids) or max(gaps) >= NEAR_TIE:
            continue
        ref = reference.get((tuple(r.prompt), r.max_tokens), ([], ""))[0]
        j = next((i for i, (a, b) in enumerate(zip(ids, ref)) if a != b), min(len(ids), len(ref)))
        ties[r.index] = f"token {j} (top-2 gap {gaps[j] if j < len(gaps) else 0.0:.1e} when fed back)"
    if wrong:
        log("chaos", f"{len(ties)} of {len(wrong)} requests that differ from the reference took a near tie")
    return ties


def _scored(llm: LLM, prompt: list[int], ids: list[int]) -> list[TokenLogprobs | None]:
    """The engine's logprobs for each of `ids` after `prompt` and the ids before it (one prefill, teacher-forced)."""
    from engine import SamplingParams

    seq = llm.engine.add_request("chaos-tie", prompt + ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                                             ignore_eos=True, prompt_logprobs=1))
    scored: list[TokenLogprobs | None] = []
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.request_id == seq.request_id and out.prompt_logprobs is not None:
                scored = out.prompt_logprobs
    return scored[len(prompt):]
