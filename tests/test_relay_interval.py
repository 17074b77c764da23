"""The relay's `every` (router.stream_interval): what a front takes from a stream's buffer, and when.

A run's chunks pass the relay (router/relay.py); with `every` tokens asked for, the front takes the first chunk at
once, then waits until the buffered chunks carry `every` tokens and takes them as one chunk, and takes what is left
when the run ends, or whatever is there once the buffer is full (so a small buffer never holds a stream back).
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from router.relay import relayed
from router.results import Chunk
from router.stall import StallClock


async def run(tokens: int, every_s: float = 0.002):
    """A run: one chunk of one token every `every_s`, the last one finishing the request."""
    for t in range(tokens):
        await asyncio.sleep(every_s)
        yield Chunk("r", [t], f" {t}", "length" if t == tokens - 1 else "")


async def taken(tokens: int, limit: int, every: int) -> list[Chunk]:
    out = []
    async with contextlib.aclosing(relayed(run(tokens), limit, 60, "r", join=Chunk.joined, every=every)) as chunks:
        async for chunk in chunks:
            out.append(chunk)
    return out


def test_every_one_token_a_chunk_by_default_and_n_tokens_a_chunk_when_asked() -> None:
    one = asyncio.run(taken(12, 16, 1))
    assert [len(c.token_ids) for c in one] == [1] * 12

    grouped = asyncio.run(taken(12, 16, 4))
    sizes = [len(c.token_ids) for c in grouped]
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 12, sizes
    assert [t for c in grouped for t in c.token_ids] == list(range(12))
    assert "".join(c.text for c in grouped) == "".join(f" {t}" for t in range(12))
    assert grouped[-1].finish_reason == "length" and not any(c.finish_reason for c in grouped[:-1])


def test_a_full_buffer_is_taken_before_it_holds_every_tokens() -> None:
    sizes = [len(c.token_ids) for c in asyncio.run(taken(10, 3, 8))]
    assert sizes[0] == 1 and max(sizes) <= 3 and sum(sizes) == 10, sizes  # never 8: the buffer holds 3 chunks


def test_a_stream_of_n_tokens_a_delta_may_go_n_steps_without_one_before_it_is_stalled():
    """The decode worker sends a delta per `stream_interval` tokens: the stall timeout (`stall_timeout_steps` of the
    worker's usual time per token) covers that many tokens, and never drops under `stall_timeout_min_s`."""
    clock = StallClock(stall_steps=100, stall_min_s=1.0)
    for _ in range(50):
        clock.observe("decode-0", 0.02)  # 20 ms a token
    assert clock.timeout("decode-0") == pytest.approx(2.0)
    assert clock.timeout("decode-0", 8) == pytest.approx(16.0)
    assert clock.timeout("decode-1", 8) == pytest.approx(80.0)  # NOTE: unmeasured: the default 0.1 s a token
    assert StallClock(stall_steps=100, stall_min_s=15.0).timeout("decode-0", 4) == 40.0
