"""The prefix index: the one module that owns the cluster's Redis key schema and TTLs (its Lua: prefix_scripts.py).

Workers (prefill/decode actors) are the only writers of block entries; routers only read (and lazily purge).
Block hashes are 32-byte sha256 digests, hex-encoded in keys. `{p}` is the cluster's prefix (default "pdc"), so
two clusters can share one Redis.

| key                  | type                | TTL                         | holds                                     |
|----------------------|---------------------|-----------------------------|-------------------------------------------|
| `{p}:epoch:{worker}` | string (int)        | none                        | the epoch; INCR on every (re)start        |
| `{p}:blk:{hashhex}`  | hash worker → epoch | BLOCK_TTL_S, on every store | the workers holding this block            |
| `{p}:wblk:{worker}`  | set of hashhex      | BLOCK_TTL_S, on every store | blocks of the current epoch               |
| `{p}:hb:{worker}`    | hash                | HEARTBEAT_TTL_S, every beat | role, epoch, address, updated, load, ... |
| `{p}:hits`           | hash of counters    | none                        | requested/cached tokens, all + per worker |
| `{p}:workers`        | set of names        | none                        | every worker that ever beat (read: `hb`)  |

A heartbeat also carries `metrics_port`, the port of the worker's own /metrics on its node.
A block entry counts only while its epoch is the worker's current epoch and the worker's heartbeat key exists.
A heartbeat, too, is written only under the current epoch: a zombie (an old incarnation still running after Ray
restarted the worker) cannot overwrite the new one's KV address, nor take its name back (`renew_epoch`).
NOTE: the block TTL is a safety net; the index follows the workers' store/evict events. A restart bumps the epoch,
which purges the old entries at once and makes late writes of the old incarnation fail the epoch check.
NOTE: the scripts touch keys they build from the prefix, so this needs a single Redis, not Redis Cluster.
NOTE: anyone who can write Redis could otherwise point the router at their own KV address, and prefill workers
would send them the cluster token and prompts: with a `signing_key` (derived from the cluster token,
`heartbeat_key`) a worker signs its heartbeat (field `sig`, an HMAC-SHA256 over every other field and its name)
and a reader drops a heartbeat whose signature is missing or wrong (logged, counted in `forged_heartbeats`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis

from cluster.messages import WorkerLoad
from cluster.prefix_scripts import SCRIPTS
from cluster.redis_breaker import RedisBreaker

log = logging.getLogger(__name__)

BLOCK_TTL_S = 3600
HEARTBEAT_TTL_S = 5.0

def heartbeat_key(cluster_token: str) -> bytes | None:
    """The key heartbeats are signed with, derived from the cluster token (None without a token: unsigned)."""
    if not cluster_token:
        return None
    return hmac.new(cluster_token.encode(), b"pdcluster heartbeat v1", hashlib.sha256).digest()


def _signature(key: bytes, prefix: str, worker: str, fields: dict[str, str]) -> str:
    """HMAC-SHA256 of a heartbeat's fields (as Redis stores them), bound to the key prefix and the worker name."""
    text = "\n".join([prefix, worker, *(f"{k}={v}" for k, v in sorted(fields.items()) if k != "sig")])
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


@dataclass
class WorkerStatus:
    """One live worker, as its last heartbeat described it."""

    name: str
    role: str
    epoch: int
    address: str
    updated: float  # unix time
    load: WorkerLoad
    metrics_port: int = 0  # the worker's own /metrics (cluster/worker_metrics.py) on its node; 0: not served


@dataclass
class HitCounts:
    """Prefix-cache hit counters, cluster-wide and per worker."""

    requested_tokens: int
    cached_tokens: int
    per_worker: dict[str, tuple[int, int]]  # worker → (requested, cached)

    @property
    def hit_rate(self) -> float:
        """cached / requested tokens; 0.0 when nothing was requested."""
        return self.cached_tokens / self.requested_tokens if self.requested_tokens else 0.0


_F = TypeVar("_F", bound=Callable[..., Any])


def _guarded(method: _F) -> _F:
    """Run a PrefixIndex method through the index's breaker (RedisUnavailable at once while it is open)."""
    @functools.wraps(method)
    def call(self: PrefixIndex, *args: Any, **kwargs: Any) -> Any:
        return self.breaker.call(lambda: method(self, *args, **kwargs))
    return call  # type: ignore[return-value]


class PrefixIndex:
    """Key schema, TTLs and Lua scripts of the prefix index; workers write their own entries, routers read.

    Every call goes through `breaker` (cluster/redis_breaker.py): a slow or full Redis fails fast after a few calls.
    """

    def __init__(self, client: redis.Redis, prefix: str = "pdc", breaker: RedisBreaker | None = None,
                 signing_key: bytes | None = None) -> None:
        self.client = client
        self.prefix = prefix
        self.breaker = breaker or RedisBreaker(prefix)
        self.signing_key = signing_key  # heartbeats are signed (workers) and checked (readers) with it
        self.forged_heartbeats = 0  # heartbeats dropped for a missing or wrong signature

    # ---- keys ----
    def _epoch_key(self, worker: str) -> str:
        return f"{self.prefix}:epoch:{worker}"

    def _wblk_key(self, worker: str) -> str:
        return f"{self.prefix}:wblk:{worker}"

    def _hb_key(self, worker: str) -> str:
        return f"{self.prefix}:hb:{worker}"

    def _blk_key(self, block_hash: bytes) -> str:
        return f"{self.prefix}:blk:{block_hash.hex()}"

    @property
    def _hits_key(self) -> str:
        return f"{self.prefix}:hits"

    # ---- worker side (the only writers of block entries) ----
    @_guarded
    def register_worker(self, worker: str) -> int:
        """Start a new epoch for `worker`, dropping every block entry of the previous one; the new epoch."""
        keys = (self._epoch_key(worker), self._wblk_key(worker))
        return int(SCRIPTS["register"](self.client, keys, (worker, f"{self.prefix}:blk:")))

    def publish(self, worker: str, epoch: int, stored: Sequence[bytes], removed: Sequence[bytes]) -> bool:
        """Record blocks `worker` stored and evicted; False (nothing written) when `epoch` is no longer current.

        `removed` is applied after `stored`: a hash in both ends up absent, so pass the net change.
        """
        # NOTE: here, not in the guarded call: a call that never reaches Redis must not count as a success
        return True if not stored and not removed else self._publish(worker, epoch, stored, removed)

    @_guarded
    def _publish(self, worker: str, epoch: int, stored: Sequence[bytes], removed: Sequence[bytes]) -> bool:
        keys = (self._epoch_key(worker), self._wblk_key(worker))
        args: list[str | int] = [worker, str(int(epoch)), f"{self.prefix}:blk:", BLOCK_TTL_S, len(stored)]
        args += [h.hex() for h in stored]
        args += [h.hex() for h in removed]
        written = bool(SCRIPTS["publish"](self.client, keys, args))
        if not written:
            log.debug("ignored publish of %s under stale epoch %d", worker, epoch)
        return written

    @_guarded
    def heartbeat(self, worker: str, epoch: int, role: str, address: str, load: WorkerLoad,
                  *, ttl_s: float | None = None, metrics_port: int = 0) -> bool:
        """Say `worker` is alive for HEARTBEAT_TTL_S (or `ttl_s`) more seconds, with its load numbers.

        False (nothing written) when `epoch` is not the worker's current epoch: a newer incarnation registered
        (this one is a zombie and must not overwrite its address), or Redis lost the epoch (register again).
        """
        ttl_ms = int((HEARTBEAT_TTL_S if ttl_s is None else ttl_s) * 1000)
        # NOTE: numeric, as the load fields: a reader of an older version turns every other field into a float
        fields: dict[str, str | float] = {"role": str(role), "epoch": int(epoch), "address": address,
                                          "updated": time.time(), "metrics_port": int(metrics_port)}
        fields.update(load.as_fields())
        keys = (self._epoch_key(worker), self._hb_key(worker), f"{self.prefix}:workers")
        args: list[str | int] = [worker, str(int(epoch)), ttl_ms]
        stored = {k: repr(v) if isinstance(v, float) else str(v) for k, v in fields.items()}
        if self.signing_key is not None:
            stored["sig"] = _signature(self.signing_key, self.prefix, worker, stored)
        for k, v in stored.items():
            args += [k, v]
        written = int(SCRIPTS["heartbeat"](self.client, keys, args))
        if written != 1:
            log.debug("ignored heartbeat of %s under %s epoch %d", worker, "lost" if written < 0 else "stale", epoch)
        return written == 1

    @_guarded
    def renew_epoch(self, worker: str, epoch: int) -> int | None:
        """A new epoch for `worker` (its entries dropped) unless a newer incarnation than `epoch` registered: None."""
        keys = (self._epoch_key(worker), self._wblk_key(worker))
        new = int(SCRIPTS["renew"](self.client, keys, (worker, f"{self.prefix}:blk:", str(int(epoch)))))
        return new or None

    @_guarded
    def current_epoch(self, worker: str) -> int | None:
        """`worker`'s current epoch; None when it never registered (or Redis lost it)."""
        raw = self.client.get(self._epoch_key(worker))
        return None if raw is None else int(raw)  # type: ignore[arg-type]

    @_guarded
    def count_hits(self, worker: str, requested_tokens: int, cached_tokens: int) -> None:
        """Add one request's requested and prefix-cached token counts to the totals and to `worker`'s."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hincrby(self._hits_key, "requested_tokens", requested_tokens)
        pipe.hincrby(self._hits_key, "cached_tokens", cached_tokens)
        pipe.hincrby(self._hits_key, f"requested_tokens:{worker}", requested_tokens)
        pipe.hincrby(self._hits_key, f"cached_tokens:{worker}", cached_tokens)
        pipe.execute()

    @_guarded
    def unregister_worker(self, worker: str, epoch: int) -> bool:
        """Graceful shutdown: drop `worker`'s blocks and heartbeat and retire `epoch`; False when it was stale."""
        # NOTE: retiring the epoch (INCR) makes a late publish from a still-running thread fail the epoch check.
        keys = (self._epoch_key(worker), self._wblk_key(worker), self._hb_key(worker))
        return bool(SCRIPTS["unregister"](self.client, keys, (worker, str(int(epoch)), f"{self.prefix}:blk:")))

    # ---- router side ----
    @_guarded
    def purge_worker(self, worker: str) -> int:
        """A worker that died without unregistering (its node was lost): drop its blocks and heartbeat and retire its
        epoch, so a late publish of it fails; the number of blocks dropped."""
        # NOTE: the one write a router makes: the dead worker cannot, and its entries would mislead routing until
        # their TTL (blocks: an hour)
        keys = (self._epoch_key(worker), self._wblk_key(worker), self._hb_key(worker))
        return int(SCRIPTS["purge"](self.client, keys, (worker, f"{self.prefix}:blk:")))

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        """For each live worker, how many leading blocks of `hashes` it holds; one round trip, 0s omitted."""
        # NOTE: a prompt shorter than a block asks nothing of Redis, and must not count as a success of it
        return self._lookup(hashes) if hashes else {}

    @_guarded
    def _lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        flat = SCRIPTS["lookup"](self.client, [self._blk_key(h) for h in hashes], (self.prefix,))
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    @_guarded
    def workers(self) -> list[WorkerStatus]:
        """Live workers (those with a heartbeat key), sorted by name."""
        # NOTE: the names come from a small set, not a SCAN: routers ask 4 times a second, and a SCAN would walk
        # every block key of the index
        head = f"{self.prefix}:hb:"
        names: set[bytes] = self.client.smembers(f"{self.prefix}:workers")  # type: ignore[assignment]
        keys = sorted(head + n.decode() for n in names)
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.hgetall(key)
        out: list[WorkerStatus] = []
        for key, raw in zip(keys, pipe.execute()):
            if not raw:  # expired between SCAN and HGETALL
                continue
            fields = {k.decode(): v.decode() for k, v in raw.items()}
            name = key[len(head):]
            sig = fields.pop("sig", "")
            if self.signing_key is not None and not hmac.compare_digest(
                    sig, _signature(self.signing_key, self.prefix, name, fields)):
                self.forged_heartbeats += 1
                if self.forged_heartbeats == 1 or self.forged_heartbeats % 100 == 0:
                    log.error("dropped a heartbeat of %r with a %s signature (%d so far): something that is not a "
                              "worker of this cluster writes to its Redis", name, "wrong" if sig else "missing",
                              self.forged_heartbeats)
                continue
            out.append(WorkerStatus(name=name, role=fields.pop("role", ""),
                                    epoch=int(fields.pop("epoch", 0)), address=fields.pop("address", ""),
                                    updated=float(fields.pop("updated", 0.0)),
                                    metrics_port=int(float(fields.pop("metrics_port", 0))),
                                    load=WorkerLoad.from_fields({k: float(v) for k, v in fields.items()})))
        return out

    @_guarded
    def hit_counts(self) -> HitCounts:
        """The prefix-cache hit counters."""
        raw: dict[bytes, bytes] = self.client.hgetall(self._hits_key)  # type: ignore[assignment]
        counts = HitCounts(requested_tokens=0, cached_tokens=0, per_worker={})
        per_worker: dict[str, list[int]] = {}
        for k, v in raw.items():
            name, _, worker = k.decode().partition(":")
            slot = 0 if name == "requested_tokens" else 1
            if worker:
                per_worker.setdefault(worker, [0, 0])[slot] = int(v)
            elif slot == 0:
                counts.requested_tokens = int(v)
            else:
                counts.cached_tokens = int(v)
        counts.per_worker = {w: (r, c) for w, (r, c) in sorted(per_worker.items())}
        return counts

    def ping(self) -> bool:
        """True when Redis answers; False instead of raising when it cannot be reached."""
        try:
            return bool(self.client.ping())
        except (redis.RedisError, OSError):
            return False

