"""The delta channel's wire (cluster/delta_server.py, router/streams.py): frames, the hello, deltas as tuples.

Frames are a 4-byte big-endian length and a pickle: both ends are this project's processes, and a peer is admitted
only with the secret that Ray handed it (the hello is plain bytes, read before anything is unpickled).
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

from cluster.messages import Delta

END = "end"  # the item after a stream's last delta: its generator returned
HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30


async def read_bytes(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> bytes:
    """The next frame's bytes; IncompleteReadError when the peer closed the connection."""
    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
    if size > limit:
        raise ConnectionError(f"a frame of {size} bytes")
    return await reader.readexactly(size)


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next frame's object (only from a peer that proved the secret: a pickle runs code)."""
    return pickle.loads(await read_bytes(reader))


def frame(obj: object) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def hello(secret: str, channel: str) -> bytes:
    """The router's first frame: plain bytes, read before anything is unpickled."""
    data = f"hello {secret} {channel}".encode()
    return HEADER.pack(len(data)) + data


PlainDelta = tuple[list[int], str, float, int, int]  # token ids, text, made_at, prompt tokens, cached tokens


def plain(token_ids: list[int], text: str, made_at: float, num_prompt_tokens: int,
          num_cached_tokens: int) -> PlainDelta:
    """A delta of only new tokens as it goes on the channel (a third of a Delta's pickle time); `from_wire` reads it.

    NOTE: the one constructor of the tuple: `to_wire` makes it of a Delta, cluster/request_stream.py straight of an
    engine output (no Delta made)."""
    return (token_ids, text, made_at, num_prompt_tokens, num_cached_tokens)


def to_wire(delta: object) -> object:
    """A delta as it goes on the channel: most carry only new tokens, as a tuple (`plain`)."""
    d = delta
    if type(d) is not Delta:  # NOTE: a call's result
        return d
    if (d.finished or d.logprobs or d.prompt_logprobs is not None or d.resumed_chars or d.queue_ms or d.prefill_ms
            or d.finish_reason or d.final_text or d.all_token_ids):
        return d
    return plain(d.token_ids, d.text, d.made_at, d.num_prompt_tokens, d.num_cached_tokens)


def from_wire(item: object) -> object:
    """The Delta of a `to_wire` tuple; anything else (a whole Delta, END, an exception) as it is."""
    if type(item) is tuple:
        ids, text, made_at, prompt, cached = item
        return Delta(ids, text, made_at=made_at, num_prompt_tokens=prompt, num_cached_tokens=cached)
    return item


def sendable(error: BaseException) -> BaseException:
    """`error`, or a RuntimeError with its text when it does not survive a pickle round trip."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any exception type may come out of a generator
        return RuntimeError(f"{type(error).__name__}: {error}")
