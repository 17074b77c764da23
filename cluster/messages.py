"""What the router and the workers send each other through Ray: small dataclasses, only what the other side needs.

NOTE: as in nano-vllm's `Sequence.__getstate__`, nothing here carries tensors or engine state: KV moves over the
KV transfer layer, never through Ray's object store.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields

from engine.logprobs import TokenLogprobs
from engine.sampling_params import SamplingParams


class Role(str, enum.Enum):
    """What a worker does: prefill only, decode only (KV arrives from a prefill worker), or both phases."""

    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    def __str__(self) -> str:  # NOTE: the plain value in f-strings, logs, metric labels and Redis fields
        return self.value

    @property
    def decodes(self) -> bool:
        """Whether requests can be decoded here (decode and colocated workers)."""
        return self is not Role.PREFILL


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's heartbeat numbers: what the router weighs when it picks a worker, and what metrics export.

    NOTE: written to Redis as one hash field per attribute (`as_fields`); fields a reader does not know are
    ignored and missing ones read as 0, so workers and routers of neighbouring versions can share one index.
    """

    running: int = 0  # sequences in the running batch
    paused: int = 0  # of those, paused until their client reads again (cluster/backlog.py)
    waiting: int = 0  # sequences queued for their first step
    reserved: int = 0  # KV reservations waiting for a transfer to land
    num_blocks: int = 0  # KV blocks in the pool
    free_blocks: int = 0  # blocks free to allocate (cached ones count as free)
    cached_blocks: int = 0  # blocks holding a prefix-cache entry
    pending_prefill_tokens: int = 0  # prompt tokens accepted but not yet computed
    prompt_tokens: int = 0  # prompt tokens seen since start
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    rss_bytes: int = 0  # resident memory of the worker's process
    spec_draft_tokens: int = 0  # speculative decoding: draft tokens verified since start
    spec_accepted_tokens: int = 0  # of those, accepted
    computed_tokens: int = 0  # tokens run through the model since start (prefill chunks + decode steps)
    # measured engine steps (cluster.worker_metrics.LinearCost over recent steps): step time ≈ base + tokens × cost
    step_base_us: int = 0  # fixed cost of a step (µs); 0: not measured yet
    step_token_ns: int = 0  # cost per token computed in a step (ns); 0: not measured yet
    max_num_batched_tokens: int = 0  # tokens one step computes at most (engine setting)
    shortest_first: int = 0  # 1: a short prompt overtakes longer ones mid-prefill (prefill_order shortest_first)

    def as_fields(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_fields(cls, raw: Mapping[str, float]) -> WorkerLoad:
        known = {f.name for f in fields(cls)}
        return cls(**{k: int(v) for k, v in raw.items() if k in known})


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the router once, at start: its model, limits, tokenizer and KV endpoint."""

    name: str
    role: Role
    epoch: int
    model_id: str
    scope: str  # block-hash scope (model id + KV dtype): the router hashes prompts in it
    block_size: int
    num_blocks: int
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    tokenizer_json: str
    kv_address: str = ""  # decode/colocated: where the KV transfer endpoint listens
    loras: dict[str, str] = field(default_factory=dict)  # resident LoRA adapters: name → block-hash key


@dataclass
class PrefillRequest:
    """Run a prompt on a prefill worker and ship its KV to `decode_address`."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    decode_address: str
    traceparent: str = ""  # W3C trace context of the router's span for this step ("" when tracing is off)


@dataclass
class PrefillResult:
    """The first token and how the prefill and the KV transfer went (durations in ms, on the worker's clock)."""

    request_id: str
    token_ids: list[int]  # the first sampled token
    text: str  # its text (may hold back characters a stop string could still need)
    finished: bool  # the request ended at its first token: nothing was handed to a decode worker
    finish_reason: str | None
    final_text: str  # when finished: the whole output text
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the prefill worker's prefix cache served
    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    kv_blocks_sent: int = 0
    kv_bytes_sent: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # params.logprobs: the first token's
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # params.prompt_logprobs: the prompt's (first: None)
    # False: sent at the first token, the KV still on its way (transfer_ms and kv_bytes_sent not final); the final
    # result follows on the same call (PrefillWorker.prefill_stream)
    handed_off: bool = True


@dataclass
class DecodeRequest:
    """Continue a request on a decode worker: take its transferred KV, or (token_ids set) run it whole here.

    NOTE: the text contract: `sent_chars` is how much of the output text the client already has (what a failed
    decode worker streamed), so this worker emits exactly the rest. None (a handoff, sent with the prefill before its
    first token exists): the characters of the first token's text that the prefill worker streamed, which the decode
    worker works out itself and reports in its first Delta (`resumed_chars`).
    """

    request_id: str
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)  # the prompt; non-empty: no transfer, this worker prefills
    output_token_ids: list[int] = field(default_factory=list)  # with token_ids: tokens generated before (failover)
    sent_chars: int | None = 0  # characters of the output text already streamed to the client
    traceparent: str = ""  # W3C trace context of the router's span for this step ("" when tracing is off)
    kv_wait_s: float = 150.0  # a handoff: how long to wait for the KV before giving the request up
    # NOTE: the router's window on this stream (Ray's generator backpressure): with this many engine outputs not yet
    # taken, the worker pauses the sequence in its engine until the router reads again (cluster/backlog.py)
    window: int = 16
    # NOTE: the router's `stream_interval`: the worker sends a delta once it has this many tokens (the stream's first
    # output, and its last, at once), so the router handles one delta per chunk its client gets
    stream_interval: int = 1


@dataclass
class Delta:
    """New tokens of one request since the last delta; the last one has `finished` set and the totals."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    final_text: str = ""
    all_token_ids: list[int] = field(default_factory=list)  # on finish: every generated token
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_ms: float = 0.0  # on the first delta of a request run whole here: waiting + prefill on this worker
    prefill_ms: float = 0.0
    resumed_chars: int = 0  # on the first delta: characters of the output text the stream assumed the client had
    # NOTE: the worker's monotonic clock when the engine produced this delta's last token (0: not stamped): the
    # router times the worker's steps by these (differences on one worker), not by when it read them
    made_at: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # params.logprobs: one per token of token_ids
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # a request run whole here: the prompt's
