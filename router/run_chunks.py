"""The chunks at a run's two ends, and the books they carry: the first token's (its timeline so far) and the last
(the rest of the text, the finish reason, usage, the whole timeline). router/flow.py's RequestRun makes them here."""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from cluster.messages import Delta, PrefillResult
from router.errors import WorkerFailed
from router.pools import WorkerPools
from router.results import Chunk, Timeline, Usage
from router.streamed_text import StreamedText


class RunBooks(Protocol):
    """What of a run (router/flow.py's RequestRun) its first and last chunks read and write."""

    request_id: str
    prompt_len: int
    arrived: float
    first_token_at: float
    num_cached: int
    generated: list[int]
    done: bool
    timeline: Timeline
    text: StreamedText
    pools: WorkerPools


def first_chunk(run: RunBooks, res: PrefillResult) -> Chunk:
    """The prefill worker's token as the first chunk (the last one when the request ended there)."""
    run.first_token_at = time.monotonic()
    tl = run.timeline
    tl.prefill_ms, tl.transfer_ms = res.prefill_ms, res.transfer_ms
    tl.queue_ms = max(0.0, (run.first_token_at - run.arrived) * 1e3 - res.prefill_ms - res.transfer_ms)
    tl.kv_blocks_sent, tl.kv_bytes_sent = res.kv_blocks_sent, res.kv_bytes_sent
    tl.first_token_ms = (run.first_token_at - run.arrived) * 1e3
    run.num_cached = res.num_cached_tokens
    # NOTE: what the KV transfer added to the first token, for predictions: nothing when the first token came
    # before the hand-off (over the delta channel), its tail after the last layer when it came after (Ray)
    run.pools.policy.transfer.observe(run.prompt_len, res.transfer_ms / 1e3 if res.handed_off else 0.0)
    run.generated += res.token_ids
    return chunk_of(run, res)


def chunk_of(run: RunBooks, out: PrefillResult | Delta) -> Chunk:
    """A worker's tokens (the prefill's first, a decode delta) as the client's next chunk: the last one, with usage
    and timeline, when they finish the request."""
    if out.finished:
        run.done = True
        chunk = last_chunk(run, out.token_ids, out.text, out.finish_reason, out.final_text)
    else:
        run.text.sent(out.text)
        chunk = Chunk(run.request_id, out.token_ids, out.text)
    chunk.logprobs, chunk.prompt_logprobs = out.logprobs, out.prompt_logprobs
    return chunk


def last_chunk(run: RunBooks, token_ids: list[int], text: str, reason: str | None, final_text: str) -> Chunk:
    """The final chunk: the rest of the text, finish reason, usage, timeline; a worker's abort fails the run."""
    if reason == "abort":
        run.done = False
        raise WorkerFailed("a worker aborted the request", run.request_id)
    now = time.monotonic()
    run.timeline.decode_ms = (now - run.first_token_at) * 1e3 if run.first_token_at else 0.0
    run.timeline.total_ms = (now - run.arrived) * 1e3
    usage = Usage(prompt_tokens=run.prompt_len, completion_tokens=len(run.generated),
                  cached_prompt_tokens=run.num_cached)
    return Chunk(run.request_id, token_ids, run.text.last(text, final_text), reason or "", usage,
                 dataclasses.replace(run.timeline))
