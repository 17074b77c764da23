"""The clients of `pdcluster bench path`: OpenAI HTTP (SSE) and gRPC, timing every token's arrival; workers' /metrics.

A chunk that carries k tokens counts as k arrivals at the same moment: a gap of 0 for all but its first token
(`return_token_ids` on HTTP, `token_ids` on gRPC say how many it carries), so merged chunks show in ITL as they
would to a user reading the stream.
"""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass, field

import aiohttp
import grpc

from pdcluster.bench.openai_client import KEEPALIVE_S
from router.v1 import inference_pb2 as pb
from router.v1 import inference_pb2_grpc as pb_grpc


@dataclass
class Timed:
    """One streamed request as its client saw it."""

    ttft_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # between consecutive tokens after the first
    tokens: int = 0
    timeline: dict[str, float] = field(default_factory=dict)  # the router's own figures, from the last chunk

    def arrived(self, n: int, now: float, t0: float, last: float) -> float:
        if not n:
            return last
        if not self.tokens:
            self.ttft_s = now - t0
            self.gaps_s += [0.0] * (n - 1)
        else:
            self.gaps_s += [now - last] + [0.0] * (n - 1)
        self.tokens += n
        return now


_sessions: dict[str, aiohttp.ClientSession] = {}


async def http_stream(addr: str, prompt: list[int], max_tokens: int) -> Timed:
    """One streamed `POST /v1/completions` (greedy, exactly `max_tokens`; no `model`: the served one)."""
    session = _sessions.get(addr)
    if session is None or session.closed:
        session = _sessions[addr] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=600))
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    r, t0 = Timed(), time.perf_counter()
    last, buf = t0, b""
    async with session.post(f"http://{addr}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for data in resp.content.iter_any():
            now = time.perf_counter()
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                payload = event.removeprefix(b"data:").strip()
                if payload == b"[DONE]" or not payload:
                    continue
                ev = json.loads(payload)
                if "error" in ev:
                    raise RuntimeError(f"stream error: {ev['error']}")
                if "pdcluster" in ev:
                    r.timeline = _timeline(ev["pdcluster"]["timeline"])
                for choice in ev.get("choices") or []:
                    # NOTE: a server without vLLM's return_token_ids: one token per chunk with text (vLLM's own
                    # benchmark counts so)
                    ids = choice.get("token_ids")
                    last = r.arrived(len(ids) if ids is not None else int(bool(choice.get("text"))), now, t0, last)
    return r


_stubs: dict[str, tuple[grpc.aio.Channel, pb_grpc.InferenceStub]] = {}


async def grpc_stream(addr: str, prompt: list[int], max_tokens: int) -> Timed:
    """One `GenerateStream` call (greedy, exactly `max_tokens`)."""
    if addr not in _stubs:
        channel = grpc.aio.insecure_channel(addr)
        _stubs[addr] = (channel, pb_grpc.InferenceStub(channel))
    stub = _stubs[addr][1]
    req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    r, t0 = Timed(), time.perf_counter()
    last = t0
    async for chunk in stub.GenerateStream(req, timeout=600):
        last = r.arrived(len(chunk.token_ids), time.perf_counter(), t0, last)
        if chunk.HasField("timeline"):
            t = chunk.timeline
            r.timeline = _timeline({k: getattr(t, k) for k in TIMELINE_PARTS})
    return r


TIMELINE_PARTS = ("queue_ms", "prefill_ms", "first_token_ms")  # arrival -> prefill starts -> first token (router)


def _timeline(t: dict[str, float]) -> dict[str, float]:
    return {k: float(t[k]) for k in TIMELINE_PARTS}


async def close_all() -> None:
    """Close every session and channel (they belong to the event loop that made them)."""
    for session in _sessions.values():
        await session.close()
    for channel, _ in _stubs.values():
        await channel.close()
    _sessions.clear()
    _stubs.clear()


# ---- the workers' own /metrics --------------------------------------------------------------------------------
def worker_steps(url: str) -> tuple[float, float]:
    """(steps, seconds) so far of a worker's engine, from its /metrics (`pdcluster_engine_step_seconds`)."""
    got = {}
    for line in _scrape(url).splitlines():
        name = line.split("{", 1)[0]
        if name in ("pdcluster_engine_step_seconds_count", "pdcluster_engine_step_seconds_sum"):
            got[name.rsplit("_", 1)[1]] = float(line.rsplit(" ", 1)[1])
    return got.get("count", 0.0), got.get("sum", 0.0)


def worker_threads(url: str) -> dict[str, float]:
    """CPU seconds so far of a worker's threads by name, from its /metrics (`pdcluster_worker_thread_cpu_seconds`)."""
    got = {}
    for line in _scrape(url).splitlines():
        if line.startswith("pdcluster_worker_thread_cpu_seconds{"):
            labels, value = line.rsplit(" ", 1)
            name = labels.split('thread="', 1)[1].rsplit('"', 1)[0]
            got[name] = float(value)
    return got


def thread_ms(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    """Each thread's CPU ms per request between two `worker_threads` reads (busiest first; threads that were
    not there before count from zero)."""
    ms = {name: (after[name] - before.get(name, 0.0)) * 1e3 / max(1, n) for name in after}
    return {name: round(v, 2) for name, v in sorted(ms.items(), key=lambda kv: -kv[1]) if v > 0}


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())
