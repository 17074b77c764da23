"""The open-loop client of `pdcluster bench serve`: send a workload's sessions on time, time every token.

Sessions start at their Poisson arrival times whatever the cluster's state (open loop: a slow cluster builds a
queue instead of slowing the load down). `run_sessions` drives the sessions over any transport given as a `Send`:
here one `GenerateStream` call over gRPC per turn (asyncio, one channel); pdcluster/bench/openai_client.py sends
the same turns to any OpenAI-compatible server. The client stamps the moment it sends, each chunk's arrival and its
token count. One asyncio process does nothing else, so its stamps are the latencies a user would see.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import grpc

from pdcluster.bench.stats import RequestRecord
from pdcluster.bench.workloads import Session, Workload
from router.v1 import inference_pb2 as pb
from router.v1 import inference_pb2_grpc as pb_grpc


async def _one(stub: pb_grpc.InferenceStub, rec: RequestRecord, prompt: list[int], t_run: float,
               metadata: tuple[tuple[str, str], ...], timeout_s: float) -> list[int]:
    """Send one turn; fill `rec`; return the answer's token ids (what the next turn resends)."""
    req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        max_tokens=rec.max_tokens, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    t0 = time.perf_counter()
    rec.sent_s = t0 - t_run
    last_t, last = t0, pb.GenerateChunk()
    try:
        async for chunk in stub.GenerateStream(req, timeout=timeout_s, metadata=metadata):
            now = time.perf_counter()
            n = len(chunk.token_ids)
            if n:
                itl_of(rec, n, now, last_t, t0, first=not tokens)
                last_t = now
                tokens += chunk.token_ids
            last = chunk
    except grpc.RpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"  # type: ignore[attr-defined]
        return tokens
    rec.e2e_ms = (time.perf_counter() - t0) * 1e3
    rec.output_len = len(tokens)
    rec.cached_tokens = last.usage.cached_prompt_tokens
    rec.transfer_ms = last.timeline.transfer_ms
    rec.prefill_worker = last.timeline.prefill_worker
    rec.decode_worker = last.timeline.decode_worker
    rec.prefill_skipped = last.timeline.prefill_skipped
    if len(tokens) != rec.max_tokens:
        rec.error = f"LENGTH: {len(tokens)} tokens, asked for exactly {rec.max_tokens}"
    return tokens


# Sends one turn: fills the record (sent_s since t_run, TTFT, gaps, ... or error) and returns the answer's token ids.
Send = Callable[[RequestRecord, list[int], float], Awaitable[list[int]]]


def itl_of(rec: RequestRecord, n: int, now: float, last_t: float, t0: float, first: bool) -> None:
    """Record a chunk of `n` tokens that arrived at `now` (the previous one at `last_t`, the request sent at `t0`)."""
    if first:
        rec.ttft_ms = (now - t0) * 1e3
        # NOTE: a first chunk with k tokens: the first is the TTFT, the other k-1 came with it (gap 0).
        rec.itl_ms += [0.0] * (n - 1)
    else:
        # NOTE: k tokens after a gap g count as k gaps of g/k (SGLang's bench_serving does the same).
        rec.itl_ms += [(now - last_t) * 1e3 / n] * n


async def _session(send: Send, s: Session, t_run: float, out: list[RequestRecord],
                   on_done: Callable[[RequestRecord], None]) -> None:
    await asyncio.sleep(max(0.0, t_run + s.arrival_s - time.perf_counter()))
    answers: list[list[int]] = []
    for i, turn in enumerate(s.turns):
        rec = RequestRecord(s.id, i, 0.0, s.prompt_len(i), turn.max_tokens)
        answers.append(await send(rec, s.prompt(i, answers), t_run))
        out.append(rec)
        on_done(rec)
        if not rec.ok:
            # NOTE: the rest of a broken conversation is never sent; count those turns as failed too.
            for j in range(i + 1, len(s.turns)):
                lost = RequestRecord(s.id, j, rec.sent_s, s.prompt_len(j), s.turns[j].max_tokens,
                                     error="NOT_SENT: an earlier turn of the session failed")
                out.append(lost)
                on_done(lost)
            return
        if i < len(s.think_s):
            await asyncio.sleep(s.think_s[i])


async def run_workload(addr: str, workload: Workload, on_done: Callable[[RequestRecord], None] = lambda r: None,
                       api_key: str | None = None, timeout_s: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Send every session of `workload` to the router at `addr`; the records (by send time) and the run's seconds."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.InferenceStub(channel)
        await channel.channel_ready()

        async def send(rec: RequestRecord, prompt: list[int], t_run: float) -> list[int]:
            return await _one(stub, rec, prompt, t_run, metadata, timeout_s)

        return await run_sessions(workload, send, on_done)


async def run_sessions(workload: Workload, send: Send,
                       on_done: Callable[[RequestRecord], None] = lambda r: None) -> tuple[list[RequestRecord], float]:
    """Every session of `workload` through `send`, each at its arrival time; the records (by send time), seconds."""
    out: list[RequestRecord] = []
    t_run = time.perf_counter()
    await asyncio.gather(*(_session(send, s, t_run, out, on_done) for s in workload.sessions))
    elapsed = time.perf_counter() - t_run
    out.sort(key=lambda r: (r.sent_s, r.session, r.turn))
    return out, elapsed


async def cluster_status(addr: str, api_key: str | None = None) -> pb.ClusterStatus:
    """The router's view of the cluster (mode, workers, prefix hits)."""
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    async with grpc.aio.insecure_channel(addr) as channel:
        return await pb_grpc.InferenceStub(channel).GetClusterStatus(
            pb.ClusterStatusRequest(), timeout=30, metadata=metadata)
