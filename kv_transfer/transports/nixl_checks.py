"""The nixl lanes' per-layer checks and fences: what a layer's bytes are checked with, on either side, and what the
sender waits for before it reads a layer of a GPU pool.

A layer's notification carries the sender's checks of its K and V blocks; the receiver computes the same over the
blocks that landed (`layer_check`). Host memory: CRC32C. GPU memory: the sum of the blocks' 32-bit words, on the
device, on a side stream of its own (`check_stream`).
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kv_transfer import payload

_checker_pool: ThreadPoolExecutor | None = None
_checker_lock = threading.Lock()


def checker() -> ThreadPoolExecutor:
    """This process's one thread computing the checks of layers queued behind the one being posted."""
    global _checker_pool
    with _checker_lock:
        if _checker_pool is None:
            _checker_pool = ThreadPoolExecutor(1, thread_name_prefix="kv-nixl-check")
        return _checker_pool


@dataclasses.dataclass(frozen=True)
class PoolLayer:
    """One layer of pool blocks to write; `ready`: on a GPU pool, an event recorded on the engine's stream right
    after the layer's forward pass queued its K/V writes (None on the host, where those writes are done)."""

    index: int
    block_ids: tuple[int, ...]
    ready: torch.cuda.Event | None = None


def layer_ready(kv: torch.Tensor) -> torch.cuda.Event | None:
    """On a GPU pool, an event on the calling thread's current stream (the engine's, inside its forward pass); None
    on the host.

    NOTE: the engine's host thread runs ahead of its GPU: when a layer's hook fires, the kernels that write that
    layer's K/V may not have run yet. NIXL's WRITE copies on UCX's own streams, unordered with the engine's, so the
    sender's thread waits for this event before it checks or posts the layer (it would send stale blocks otherwise).
    """
    if kv.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(kv.device))
    return event


_streams = threading.local()


def check_stream(device: torch.device) -> torch.cuda.Stream | None:
    """This thread's side stream for the checks and copies of GPU layers; None on the host (`torch.cuda.stream(None)`
    is a no-op there).

    NOTE: on the engine's stream (the legacy default one) a check, and the `int()` that reads it, waits for every
    kernel queued there before it: on a decode worker the decode steps queued (two checks a layer, one transfer
    after another on the notification thread), on a prefill worker the rest of the prefill (no layer could go before
    it ended). On an H200 (BENCHMARKS.md, issue 38), 8B hand-offs of ~1,000 tokens under load took 3.4-4.9 s (p50)
    that way, 0.23-2.2 s with this stream. A stream of torch's pool does not synchronize with the default one; the
    blocks checked are ready when the check runs (the sender waited for the layer's event, the receiver for NIXL's
    notification, which follows the write).
    """
    if device.type != "cuda":
        return None
    stream = getattr(_streams, "stream", None)
    if stream is None or stream.device != device:
        stream = _streams.stream = torch.cuda.Stream(device)
    return stream


def layer_check(kv: torch.Tensor, block_ids: np.ndarray, place: str, enabled: bool = True,
                like: str | None = None) -> str:
    """The check of blocks `block_ids` of one layer's K or V (`kv`: [num_blocks, *block_shape]), in order.

    Host memory: CRC32C of `place`, continued over each run of consecutive blocks (views, no copy). GPU memory: "s"
    and the int64 sum of the blocks' 32-bit words (computed on the device; weaker than a CRC, catches lost or
    misplaced blocks). "-" when checks are turned off (`TransferConfig.nixl_checksum`). The receiver computes the
    kind of check the sender sent (`like`), whichever memory its own pool is in.
    """
    if not enabled or like == "-":
        return "-"
    if (like is None and kv.device.type != "cpu") or (like is not None and like.startswith("s")):
        with torch.cuda.stream(check_stream(kv.device)):
            words = kv[torch.as_tensor(block_ids, device=kv.device)].contiguous().view(torch.int32)
            return f"s{int(words.sum(dtype=torch.int64))}"
    value = payload.crc32c(place.encode())
    if kv.device.type != "cpu":
        return str(payload.crc32c(kv[torch.as_tensor(block_ids, device=kv.device)].cpu(), value))
    if len(block_ids):
        # NOTE: byte slices of one view of the layer, not a tensor per run: a decode pool hands out blocks in
        # descending runs (freed tail first), so a layer is ~128 one-block runs, and slicing tensors per run made
        # the check 6x slower than the CRC itself (40 ms against 7 ms per 94 MB, issue 30's send profile)
        raw = payload.as_bytes(kv)
        size = raw.nbytes // kv.shape[0]
        firsts, lasts = block_runs(block_ids)
        for first, last in zip(firsts, lasts, strict=True):
            value = payload.crc32c(raw[first * size : (last + 1) * size], value)
    return str(value)


def layers_check(kvs: list[torch.Tensor], layer: int, which: int, block_ids: np.ndarray, place: str,
                 enabled: bool = True, like: str | None = None) -> str:
    """`layer_check` of K (which=0) or V (1) of `layer` over a pool of one tensor per TP rank: the ranks' checks
    joined by "+" (rank r's place suffixed "/r"; one rank: `layer_check` itself), compared as a whole."""
    likes = like.split("+") if like is not None else [None] * len(kvs)
    if len(likes) != len(kvs):
        return "ranks differ"  # NOTE: never equal to a sender's check: the transfer fails as corrupt
    return "+".join(layer_check(kv[layer, which], block_ids, place if r == 0 else f"{place}/{r}", enabled, theirs)
                    for r, (kv, theirs) in enumerate(zip(kvs, likes, strict=True)))


def block_runs(block_ids: np.ndarray) -> tuple[list[int], list[int]]:
    """The first and last block id of each run of consecutive ascending ids in `block_ids`, in order."""
    cuts = np.flatnonzero(np.diff(block_ids) != 1) + 1
    return (block_ids[np.concatenate(([0], cuts))].tolist(),
            block_ids[np.concatenate((cuts - 1, [len(block_ids) - 1]))].tolist())
