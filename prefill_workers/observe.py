"""What a prefill reports once its KV is handed off: the first token's timing, its log line, metrics and spans."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from cluster import tracing
from cluster.messages import PrefillRequest
from cluster.worker import Worker
from engine.output import RequestOutput
from kv_transfer.sender import KVSender

log = logging.getLogger("prefill_workers.worker")


@dataclass
class FirstToken:
    """What the step that completed the prompt produced, and when (monotonic; queue and prefill in ms)."""

    output: RequestOutput
    at: float
    queue_ms: float
    prefill_ms: float
    arrived: float  # when the request came to this worker (monotonic)
    prompt_tokens: int


def observe(worker: Worker, req: PrefillRequest, first: FirstToken, sender: KVSender, transfer_ms: float) -> None:
    """This worker's log line, metrics and the queue / prefill spans of the request (monotonic clock times)."""
    out = first.output
    log.debug("prefilled %d tokens (%d cached) in %.0f ms after %.0f ms queued; sent %d blocks (%d bytes) to %s, "
              "%.1f ms after the first token", first.prompt_tokens, out.num_cached_tokens, first.prefill_ms,
              first.queue_ms, sender.num_blocks, sender.bytes_sent, req.decode_address, transfer_ms)
    metrics = worker.metrics
    metrics.generation.inc(len(first.output.new_token_ids))
    if not first.output.finished:
        metrics.transfer.observe(transfer_ms / 1e3)
    if tracing.enabled():
        now, now_ns = time.monotonic(), time.time_ns()
        started = first.arrived + first.queue_ms / 1e3
        tracing.record("queue", req.traceparent, tracing.wall_ns(first.arrived, now, now_ns),
                       tracing.wall_ns(started, now, now_ns))
        tracing.record("prefill", req.traceparent, tracing.wall_ns(started, now, now_ns),
                       tracing.wall_ns(first.at, now, now_ns), **{"pdcluster.prompt_tokens": first.prompt_tokens,
                                                                  "pdcluster.cached_tokens":
                                                                      first.output.num_cached_tokens})
