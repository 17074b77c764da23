"""What the router hands its fronts: plain dataclasses (the gRPC service converts them to protobuf at the edge).

Field names and order follow proto/router/v1/inference.proto, so a front may copy them across field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.logprobs import TokenLogprobs


def fields_of(item: Usage | Timeline) -> dict[str, Any]:
    """A flat dataclass's fields by name (`dataclasses.asdict` deep-copies each value: ~4x the time)."""
    return {name: getattr(item, name) for name in item.__slots__}


@dataclass(slots=True)
class Usage:
    """Token counts of a finished request."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from a prefix cache instead of computed


@dataclass(slots=True)
class Timeline:
    """Where one request spent its time, and which workers served it."""

    queue_ms: float = 0.0  # arrival at the router → its prefill started on a worker
    prefill_ms: float = 0.0  # prefill compute, up to the first token
    transfer_ms: float = 0.0  # first token → KV handed to the decode worker
    first_token_ms: float = 0.0  # arrival → first token sent (time to first token)
    decode_ms: float = 0.0  # first token → last token
    total_ms: float = 0.0  # arrival → last token
    prefill_worker: str = ""  # empty when prefill was skipped
    decode_worker: str = ""
    prefill_skipped: bool = False  # the decode worker ran the whole prompt
    kv_blocks_sent: int = 0
    kv_bytes_sent: int = 0
    placement: str = ""  # where the prompt was computed: prefill_pool, prefix, slo, no_prefill (router/policy.py)
    predicted_ttft_ms: float = 0.0  # the router's prediction of first_token_ms when it placed the request


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of one tool call of a chat answer (router/tool_stream.py): its first piece names it, the next ones
    carry its arguments (JSON text) in pieces; pieces of one `index` concatenated give the whole call."""

    index: int  # the call's place in the answer (0, 1, ...)
    id: str = ""  # first piece only: "call_<hex>"
    name: str = ""  # first piece only: the function called
    arguments: str = ""  # the next piece of the arguments' JSON text


@dataclass(slots=True)
class Chunk:
    """New tokens of one request; the last chunk has a finish reason, usage and the timeline."""

    request_id: str
    token_ids: list[int]  # new tokens since the last chunk
    text: str  # new text since the last chunk
    finish_reason: str = ""  # "stop" | "length" on the last chunk only
    usage: Usage | None = None  # last chunk only
    timeline: Timeline | None = None  # last chunk only
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # params.logprobs: one per token of token_ids
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # params.prompt_logprobs: on the first chunk
    index: int = 0  # the choice (n > 1: router/fanout.py)
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # a chat with tools: calls parsed out of the text

    def joined(self, nxt: Chunk) -> Chunk | None:
        """This chunk and the next one of its stream as one (None where they cannot be: another choice, or this one
        ends the stream, or either carries tool-call pieces, whose order a client reads one delta at a time)."""
        if nxt.index != self.index or self.finish_reason or self.usage is not None or self.timeline is not None \
                or self.tool_calls or nxt.tool_calls or nxt.prompt_logprobs is not None:
            return None
        return Chunk(self.request_id, self.token_ids + nxt.token_ids, self.text + nxt.text, nxt.finish_reason,
                     nxt.usage, nxt.timeline, self.logprobs + nxt.logprobs, self.prompt_logprobs, self.index)


@dataclass(slots=True)
class WorkerStatus:
    """One worker in a cluster status: its heartbeat load and prefix hits."""

    name: str
    role: str  # "prefill", "decode" or "colocated"
    epoch: int  # bumps on every (re)start
    address: str  # KV transfer endpoint (decode) or empty
    alive: bool
    running: int
    waiting: int
    num_blocks: int
    free_blocks: int
    cached_blocks: int
    requested_prompt_tokens: int
    cached_prompt_tokens: int
    heartbeat_age_s: float
    rss_bytes: int


@dataclass(slots=True)
class ClusterStatus:
    """Workers, their load and KV blocks, and prefix-hit counts, as Redis has them."""

    model: str
    mode: str  # "disaggregated" or "colocated"
    workers: list[WorkerStatus] = field(default_factory=list)
    requested_prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefix_hit_rate: float = 0.0  # cached / requested prompt tokens, all workers
    redis_ok: bool = False
    router_inflight: int = 0  # requests in flight on the router that answered
