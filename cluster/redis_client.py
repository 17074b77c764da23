"""The one way pdcluster opens a Redis client: URL plus optional ACL user, password and TLS CA bundle."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis


@dataclass(frozen=True)
class RedisAuth:
    """How to authenticate to Redis: an ACL user and password, and a CA bundle for rediss:// (TLS)."""

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: str | None = None


def connect(url: str, auth: RedisAuth | None = None, *, timeout_s: float = 2.0) -> redis.Redis:
    """A bytes-returning client for `url` (hiredis parser when installed), with `timeout_s` socket timeouts.

    NOTE: a slow Redis costs each caller up to `timeout_s`; the prefix index's breaker (cluster/redis_breaker.py)
    stops calling it after a few such calls.
    """
    # NOTE: redis-py picks the hiredis parser by itself when hiredis is importable.
    extra: dict[str, object] = {}
    if auth is not None:
        extra = {k: v for k, v in (("username", auth.username), ("password", auth.password)) if v}
        if auth.ca_file:
            extra["ssl_ca_certs"] = auth.ca_file
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                health_check_interval=0, decode_responses=False, **extra)
