"""Secrets and TLS from the config: API keys, the cluster token, Redis credentials, server certificates.

NOTE: secrets never sit in YAML: the config names environment variables, read here once at start. Nothing in this
module logs a secret; errors name the variable, not its value.
"""

from __future__ import annotations

import os
import secrets
import ssl
from urllib.parse import urlsplit

import grpc

from cluster.redis_client import RedisAuth
from kv_transfer.tls import KVTls
from pdcluster.config import ClusterConfig
from router import auth


class SetupError(ValueError):
    """A setting that cannot be used at start (a missing secret, an unreadable certificate); names the field."""


def _env(name: str, field: str) -> str:
    value = os.environ.get(name, "")
    if not value:
        raise SetupError(f"{field}: the environment variable {name} is not set (or empty)")
    return value


def _keys(name: str | None, field: str) -> frozenset[str]:
    """The comma-separated keys in environment variable `name` (None: none asked for, empty); `field` names it."""
    if name is None:
        return frozenset()
    keys = frozenset(k.strip() for k in _env(name, field).split(",") if k.strip())
    if not keys:
        raise SetupError(f"{field}: {name} holds no key")
    return keys


def api_keys(config: ClusterConfig) -> frozenset[str]:
    """The keys clients must present (empty: no check), from `security.api_keys_env` (comma-separated)."""
    return _keys(config.security.api_keys_env, "security.api_keys_env")


def admin_api_keys(config: ClusterConfig) -> frozenset[str]:
    """The keys of admin calls (Scale), from `security.admin_api_keys_env`; empty: the API keys open them too."""
    return _keys(config.security.admin_api_keys_env, "security.admin_api_keys_env")


def cluster_token(config: ClusterConfig) -> str:
    """The token KV transfer peers present: `security.cluster_token_env`, or a fresh random one per start."""
    name = config.security.cluster_token_env
    return _env(name, "security.cluster_token_env") if name else secrets.token_urlsafe(32)


def redis_auth(config: ClusterConfig) -> RedisAuth:
    """How to log in to `redis.url`: `redis.password_env`, or the password of this user's embedded server there."""
    r = config.redis
    password = _env(r.password_env, "redis.password_env") if r.password_env else None
    if password is None and r.url is not None:
        # NOTE: an extra router (`pdcluster router --redis 127.0.0.1:PORT`) of the user whose `serve` started the
        # embedded server: its random password sits in a file only that user can read (pdcluster/redis_files.py)
        from pdcluster.redis_files import embedded_password

        parts = urlsplit(r.url)
        if parts.hostname in ("127.0.0.1", "localhost", "::1") and parts.port and not parts.password:
            password = embedded_password(parts.port)
    return RedisAuth(r.username, password, r.tls_ca_file)


def _read(path: str, field: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SetupError(f"{field}: cannot read {path}: {e.strerror}") from None


def grpc_credentials(config: ClusterConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC server, or None for plaintext."""
    s = config.security
    if s.tls_cert_file is None or s.tls_key_file is None:
        return None
    return grpc.ssl_server_credentials([(_read(s.tls_key_file, "security.tls_key_file"),
                                         _read(s.tls_cert_file, "security.tls_cert_file"))])


def ssl_context(config: ClusterConfig) -> ssl.SSLContext | None:
    """A TLS context for the HTTP fronts (OpenAI API, metrics), or None for plaintext."""
    s = config.security
    if s.tls_cert_file is None or s.tls_key_file is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(s.tls_cert_file, s.tls_key_file)
    except (OSError, ssl.SSLError) as e:
        raise SetupError(f"security.tls_cert_file/tls_key_file: cannot load them: {e}") from None
    return ctx


def check_exposure(config: ClusterConfig) -> None:
    """SetupError when a front would serve other machines without API keys (router.host, http.host) unless
    `security.allow_unauthenticated`; run before anything starts. Metrics stay open, as Prometheus scrapes them."""
    keys = api_keys(config)
    fronts = [("router.host", config.router.host)] + ([("http.host", config.http.host)] if config.http.enabled else [])
    for field, host in fronts:
        try:
            auth.check_exposure(host, keys, config.security.allow_unauthenticated, field)
        except auth.ExposureError as e:
            raise SetupError(str(e)) from None


def kv_tls(config: ClusterConfig) -> KVTls | None:
    """Mutual TLS for the KV gRPC plane (`transfer.tls`): the cluster's certificate, key and CA, or None."""
    s = config.security
    if not config.transfer.tls or s.tls_cert_file is None or s.tls_key_file is None:
        return None
    cert = _read(s.tls_cert_file, "security.tls_cert_file")
    ca = _read(s.tls_ca_file, "security.tls_ca_file") if s.tls_ca_file else cert
    return KVTls(cert, _read(s.tls_key_file, "security.tls_key_file"), ca, _cert_name(s.tls_cert_file))


def _cert_name(path: str) -> str:
    """A DNS name the certificate is issued for (its first DNS subjectAltName, else its common name)."""
    # NOTE: the stdlib's only certificate parser is private; it has been stable since Python 3.4
    try:
        decoded = ssl._ssl._test_decode_cert(path)  # type: ignore[attr-defined]
    except (OSError, ssl.SSLError) as e:
        raise SetupError(f"security.tls_cert_file: cannot parse {path}: {e}") from None
    names = [v for k, v in decoded.get("subjectAltName", ()) if k == "DNS"]
    names += [v for rdn in decoded.get("subject", ()) for k, v in rdn if k == "commonName"]
    if not names:
        raise SetupError("security.tls_cert_file: names no DNS subjectAltName or common name (needed for KV TLS)")
    return str(names[0])
