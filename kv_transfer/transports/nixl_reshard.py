"""The nixl lane between TP groups of different sizes: which sender ranks make each receiver rank's blocks, and the
sender's staging arena for the blocks no one sender rank holds as a receiver rank does.

A pool block is [rows, local KV heads, D], the heads interleaved row by row, so a receiver rank whose heads are not
exactly one sender rank's wants a strided share of one sender block (TP a < b: a subset of its heads) or of several
(a > b: heads of several ranks). Rank 0 of a CPU group maps every rank's pool (engine/parallel/shared_pool.py), so
the sender makes such blocks itself:
1. the handshake carries both head splits: the sender's (`PrepareRequest.nixl_heads`, a range per rank) and the
   receiver's (`NixlTarget.shard_heads`); a split that leaves a head out is refused naming the field;
2. `Plan`: per receiver rank, the first sender rank holding exactly its heads (its blocks go straight from that
   rank's pool, as between groups of one TP size: no copy), or else, for each of its heads, the first sender rank
   holding it: that rank's blocks are gathered;
3. per layer, the sender copies K and V of the gathered ranks' blocks into a slot of this process's staging arena
   (nixl_writes.py `Staging`: host memory registered with NIXL once per chunk), computes the checks over the slot,
   and posts the layer's one WRITE, pairing each receiver rank's blocks with runs of a sender pool or of the slot;
   the slot is freed when the write completed (or never, when the peer had to be dropped with the write in flight).
The receiver does as for one TP size: it checks each of its ranks' blocks as they landed (one check per receiver
rank, joined by "+") and copies nothing.

Why gather on the sender rather than scatter on the receiver (a staging area there, each sender rank's contiguous
block written into it, copied into the head columns after its check): the copy is the same one, but on the sender
(a) the receiver's check, fence and pool stay as they are, with no write of its own racing a freed reservation;
(b) the sender learns when each write completed, so a slot lives for one layer's write, where a receiver's area
must hold a transfer's every layer from its handshake on (no word goes back per layer) and be registered before a
sender loads the receiver's metadata; (c) the copy costs the prefill worker's CPU, not the decode core's, which
steps every running stream. Descriptors per row instead of a copy (no staging at all) would be one UCX put per
token row, K/V, layer and sender rank: 2,048 x 2 x 30 x 3 = 368,640 puts of 256 bytes (64 dims x 4 bytes) for a
2,048-token SmolLM2 prompt at TP 3 → 1, against 2 x 30 puts of 1.5 MiB gathered (not measured: UCX makes one copy
per descriptor, and per-block descriptors of 12 KiB already ran at 7 GB/s against 10.6 for runs, BENCHMARKS.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kv_transfer import payload
from kv_transfer.transports.nixl_agent import Peer, Pool, run_descs, runs
from kv_transfer.transports.nixl_checks import block_runs, layer_check

Heads = list[tuple[int, int]]  # the model's KV heads each rank's pool holds, (first, stop) in rank order


def heads_problem(heads: Heads, ranks: int, num_kv_heads: int) -> str | None:
    """Why `heads` cannot be the head split of a pool of `ranks` ranks over `num_kv_heads` heads (None: it can)."""
    if len(heads) != ranks:
        return f"{len(heads)} ranks' heads for a pool of {ranks} ranks"
    for first, stop in heads:
        if not 0 <= first < stop <= num_kv_heads:
            return f"({first}, {stop}) is not a range of the model's {num_kv_heads} KV heads"
    if len({stop - first for first, stop in heads}) != 1:
        return f"ranks of one pool hold as many heads each, not {heads}"
    held = {h for first, stop in heads for h in range(first, stop)}
    if len(held) != num_kv_heads:
        return f"the ranks hold {len(held)} of the model's {num_kv_heads} KV heads"
    return None


@dataclass(frozen=True, slots=True)
class Span:
    """Head columns [first, stop) of sender rank `rank`'s blocks, at column `at` of a gathered receiver block."""

    rank: int
    first: int
    stop: int
    at: int


@dataclass(frozen=True, slots=True)
class Target:
    """How one receiver rank's blocks are made: straight from sender rank `direct`'s pool, or gathered (`spans`)
    into a slot after `before` bytes per block of the gathered ranks ahead of it."""

    direct: int | None
    spans: tuple[Span, ...] = ()
    before: int = 0


class Plan:
    """Which sender ranks make each receiver rank's blocks, and where a layer's gathered blocks sit in its slot:
    [K | V], each [gathered receiver ranks in order][blocks][rows, that rank's heads, D]."""

    def __init__(self, src: Heads, dst: Heads, head_nbytes: int) -> None:
        self.src, self.dst = src, dst
        self.block_nbytes = [(stop - first) * head_nbytes for first, stop in dst]  # a block, per receiver rank
        self.targets: list[Target] = []
        self.staged = 0  # bytes per block of K (or V) of every gathered receiver rank
        for r, (first, stop) in enumerate(dst):
            if (first, stop) in src:
                self.targets.append(Target(src.index((first, stop))))
                continue
            self.targets.append(Target(None, self._spans(first, stop), self.staged))
            self.staged += self.block_nbytes[r]

    def _spans(self, first: int, stop: int) -> tuple[Span, ...]:
        spans: list[Span] = []
        for head in range(first, stop):
            rank = next((s for s, (a, b) in enumerate(self.src) if a <= head < b), None)
            if rank is None:
                raise ValueError(f"KV head {head} is in no sender rank's pool")
            col = head - self.src[rank][0]
            last = spans[-1] if spans else None
            if last is not None and last.rank == rank and last.stop == col:
                spans[-1] = Span(rank, last.first, col + 1, last.at)
            else:
                spans.append(Span(rank, col, col + 1, head - first))
        return tuple(spans)

    @property
    def gathers(self) -> bool:
        """Whether some receiver rank's blocks are gathered (a slot per layer)."""
        return self.staged > 0

    def slot_nbytes(self, n: int) -> int:
        """A layer's slot for `n` blocks (K and V of the gathered ranks)."""
        return 2 * n * self.staged

    def nbytes(self, n: int) -> int:
        """Bytes a layer of `n` blocks writes into the receiver (every rank's, replicas included)."""
        return 2 * n * sum(self.block_nbytes)

    def _view(self, slot: torch.Tensor, which: int, r: int, n: int, like: torch.Tensor) -> torch.Tensor:
        """Receiver rank r's gathered K (which=0) or V blocks in `slot`: [n, rows, its heads, D] (`like`'s dtype)."""
        start = which * n * self.staged + n * self.targets[r].before
        raw = slot[start : start + n * self.block_nbytes[r]]
        first, stop = self.dst[r]
        return raw.view(like.dtype).view(n, like.shape[-3], stop - first, like.shape[-1])

    def gather(self, kvs: list[torch.Tensor], layer: int, ids: np.ndarray, slot: torch.Tensor) -> None:
        """K and V of blocks `ids` of `layer` for every gathered receiver rank, copied from the sender's pools
        (`kvs`, [layers, 2, pool blocks, rows, heads, D] per rank) into `slot` (uint8, `slot_nbytes`)."""
        firsts, lasts = block_runs(ids)
        index = torch.as_tensor(ids) if len(firsts) > 16 else None  # NOTE: many short runs: one gather instead
        for which in (0, 1):
            for r, t in enumerate(self.targets):
                if t.direct is not None:
                    continue
                out = self._view(slot, which, r, len(ids), kvs[0])
                for sp in t.spans:
                    cols = slice(sp.at, sp.at + sp.stop - sp.first)
                    src = kvs[sp.rank][layer, which, :, :, sp.first : sp.stop]  # [pool blocks, rows, c, D]
                    if index is not None:
                        out[:, :, cols] = src[index]
                        continue
                    i = 0
                    for a, b in zip(firsts, lasts):
                        out[i : i + b - a + 1, :, cols].copy_(src[a : b + 1])
                        i += b - a + 1

    def checks(self, kvs: list[torch.Tensor], layer: int, which: int, ids: np.ndarray, place: str, enabled: bool,
               slot: torch.Tensor | None) -> str:
        """The check of each receiver rank's K (which=0) or V blocks of `layer`, joined by "+", as the receiver
        computes them over its ranks' pools (`nixl_checks.layers_check`: rank r's place suffixed "/r")."""
        out = []
        for r, t in enumerate(self.targets):
            where = place if r == 0 else f"{place}/{r}"
            if t.direct is not None:
                out.append(layer_check(kvs[t.direct][layer, which], ids, where, enabled))
            elif not enabled:
                out.append("-")
            else:
                assert slot is not None
                view = self._view(slot, which, r, len(ids), kvs[0])
                out.append(str(payload.crc32c(view, payload.crc32c(where.encode()))))
        return "+".join(out)

    def descs(self, pool: Pool, peer: Peer, layer: int, local: np.ndarray, remote: np.ndarray,
              slot_addr: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, destination) descriptors [rows, 3] of one layer's WRITE: per receiver rank, one per run of
        blocks consecutive on both sides (a slot's blocks are consecutive), its K runs, then its V runs."""
        src, dst = [], []
        n = len(local)
        direct = runs(local, remote)  # NOTE: the same runs for every receiver rank fed straight from a pool ...
        slotted = runs(np.arange(n, dtype=np.int64), remote) if self.gathers else direct  # ... or from the slot
        for r, t in enumerate(self.targets):
            if t.direct is not None:
                ls, rs, lengths = direct
                src.append(run_descs(pool.kvs[t.direct].data_ptr(), pool.num_blocks, pool.block_nbytes, pool.device,
                                     layer, ls, lengths))
            else:
                ls, rs, lengths = slotted
                blk = self.block_nbytes[r]
                part = np.empty((2 * len(ls), 3), dtype=np.uint64)
                for which in (0, 1):
                    rows = part[which * len(ls) : (which + 1) * len(ls)]
                    rows[:, 0] = np.uint64(slot_addr + which * n * self.staged + n * t.before) + \
                        ls.astype(np.uint64) * np.uint64(blk)
                    rows[:, 1] = lengths.astype(np.uint64) * np.uint64(blk)
                    rows[:, 2] = 0
                src.append(part)
            dst.append(run_descs(peer.addrs[r], peer.num_blocks, peer.block_nbytes, peer.device, layer, rs, lengths))
        return np.concatenate(src), np.concatenate(dst)
