"""The cluster-wide sections of the deploy config: Ray, Redis, the HTTP front, metrics, tracing, logging, security,
KV transfer and the autoscaler (each a pydantic model with extra="forbid")."""

from __future__ import annotations

import functools
import logging
import re
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdcluster.config_rules import RuleError as _RuleError

if TYPE_CHECKING:
    from cluster.tracing import TracingSettings
    from kv_transfer.state import TransferConfig

_RAY_ADDRESS = re.compile(r"^(ray://)?(\[[0-9a-fA-F:]+\]|[^\s:/\[\]]+):\d{1,5}$")


class RayConfig(BaseModel):
    """Which Ray cluster the pools run on."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(default="local", description="'local': a private Ray in this process; 'auto': join the "
                                                       "running cluster; or 'ray://host:port' / 'host:port'")
    namespace: str = Field(default="pdcluster", min_length=1, description="Ray namespace of the named actors")
    num_cpus: float | None = Field(default=None, gt=0, description="CPUs of a private Ray (address 'local' only)")
    # NOTE: the workers are detached actors either way (a router that crashes leaves them serving); this says
    # whether a `serve` stopped by a signal stops them too
    keep_workers: bool = Field(default=False, description="`serve` leaves its workers running when stopped (a later "
                               "`serve` re-attaches to them, prefix caches and all); needs security.cluster_token_env")

    @field_validator("address")
    @classmethod
    def _check_address(cls, v: str) -> str:
        if v not in ("local", "auto") and not _RAY_ADDRESS.match(v):
            raise ValueError(f"must be 'local', 'auto', 'ray://host:port' or 'host:port', got {v!r}")
        return v

    @model_validator(mode="after")
    def _check(self) -> RayConfig:
        if self.keep_workers and self.address == "local":
            raise _RuleError("keep_workers", "a private Ray ('local') stops with `serve`, workers and all: join a Ray "
                                             "that outlives it (address 'auto' or host:port, after `ray start --head`)")
        if self.num_cpus is not None and self.address != "local":
            raise _RuleError("num_cpus", f"only with address 'local'; the nodes of cluster {self.address!r} declare "
                                         "their own CPUs (`ray start --num-cpus`)")
        return self


class RedisConfig(BaseModel):
    """The Redis that holds the prefix index."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = Field(default=None, description="redis:// or rediss:// (TLS) URL; null: an embedded redis-server")
    key_prefix: str = Field(default="pdc", min_length=1, pattern=r"^\S+$", description="prefix of every key written")
    username: str | None = Field(default=None, min_length=1, description="Redis ACL user (with password_env)")
    # NOTE: the password itself never sits in YAML: it is read from this environment variable at start.
    password_env: str | None = Field(default=None, min_length=1, description="environment variable holding the "
                                                                            "Redis password")
    tls_ca_file: str | None = Field(default=None, min_length=1, description="CA bundle to verify a rediss:// server")

    @field_validator("url")
    @classmethod
    def _check_url(cls, v: str | None) -> str | None:
        if v is not None and urlsplit(v).scheme not in ("redis", "rediss"):
            raise ValueError(f"must be a redis:// or rediss:// URL (or null for the embedded server), got {v!r}")
        return v


class HttpConfig(BaseModel):
    """The OpenAI-compatible HTTP front, served by the router process next to gRPC."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="serve /v1/completions, /v1/chat/completions, /v1/models, /health")
    host: str = Field(default="127.0.0.1", min_length=1, description="address to bind")
    port: int = Field(default=8000, ge=0, le=65535, description="port to bind; 0 picks a free one")
    served_model_name: str | None = Field(default=None, min_length=1,
                                          description="the model id clients pass (default: the config's model)")


class MetricsConfig(BaseModel):
    """Prometheus metrics of the router process (its requests, and the workers' load through Redis)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=True, description="serve /metrics in the Prometheus text format")
    host: str = Field(default="127.0.0.1", min_length=1, description="address to bind")
    port: int = Field(default=9400, ge=0, le=65535, description="port to bind; 0 picks a free one")
    workers: bool = Field(default=True, description="each worker serves its own /metrics (vLLM's names) on a port "
                                                    "of its own, advertised in its heartbeat")
    worker_host: str = Field(default="127.0.0.1", min_length=1, description="address workers bind their /metrics "
                             "to; 'auto': each worker's node IP")
    worker_port: int = Field(default=0, ge=0, le=65535, description="0: a free port per worker; N: worker i of the "
                             "cluster (pools in order) takes N + i")


class TracingConfig(BaseModel):
    """OpenTelemetry spans of each request (queue, prefill, KV transfer, decode), exported over OTLP/gRPC."""

    model_config = ConfigDict(extra="forbid")

    otlp_endpoint: str | None = Field(default=None, min_length=1, description="OTLP/gRPC collector, e.g. "
                                      "http://127.0.0.1:4317; null: tracing off (nothing is created)")
    service_name: str = Field(default="pdcluster", min_length=1, description="service.name of the spans")
    sample_ratio: float = Field(default=1.0, ge=0, le=1, description="share of new traces recorded (a client's "
                                "traceparent decides for its own)")
    insecure: bool = Field(default=True, description="plain gRPC to the collector (false: TLS)")

    def settings(self) -> TracingSettings:
        """What each process of the cluster configures its tracer with."""
        from cluster.tracing import TracingSettings

        return TracingSettings(otlp_endpoint=self.otlp_endpoint or "", service_name=self.service_name,
                               sample_ratio=self.sample_ratio, insecure=self.insecure)


class LoggingConfig(BaseModel):
    """Logs of the router and every worker (each record carries its component and request id)."""

    model_config = ConfigDict(extra="forbid")

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="lowest level logged")
    format: Literal["text", "json"] = Field(default="text", description="'json': one object per line, for pipelines")


class SecurityConfig(BaseModel):
    """TLS for the gRPC and HTTP fronts, API keys for clients, a token between cluster members."""

    model_config = ConfigDict(extra="forbid")

    tls_cert_file: str | None = Field(default=None, min_length=1, description="PEM certificate chain (gRPC and HTTP)")
    tls_key_file: str | None = Field(default=None, min_length=1, description="PEM private key of tls_cert_file")
    tls_ca_file: str | None = Field(default=None, min_length=1, description="PEM CA certificate(s) that signed "
                                    "tls_cert_file: with transfer.tls, KV peers must present a certificate it signed; "
                                    "unset: tls_cert_file itself (self-signed)")
    # NOTE: keys and tokens never sit in YAML: these name environment variables that hold them.
    api_keys_env: str | None = Field(default=None, min_length=1, description="environment variable with the API "
                                     "keys clients must send (comma-separated); unset: no key needed")
    cluster_token_env: str | None = Field(default=None, min_length=1, description="environment variable with the "
                                          "token KV transfer peers must present; unset: a random one per start")
    admin_api_keys_env: str | None = Field(default=None, min_length=1, description="environment variable with the "
                                           "keys of admin calls (Scale), comma-separated; unset: api_keys open them")
    # NOTE: as Redis's protected mode: a router bound to a non-loopback address (router.host / http.host) without
    # API keys is refused at start unless this says so (pdcluster/security.py, check_exposure)
    allow_unauthenticated: bool = Field(default=False, description="serve other machines without API keys "
                                        "(router.host / http.host not loopback and no api_keys_env)")

    @model_validator(mode="after")
    def _check(self) -> SecurityConfig:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            missing = "tls_key_file" if self.tls_key_file is None else "tls_cert_file"
            raise _RuleError(missing, "TLS needs both tls_cert_file and tls_key_file")
        return self


class TransferSection(BaseModel):
    """How KV blocks move from prefill to decode workers."""

    model_config = ConfigDict(extra="forbid")

    # NOTE: kv_transfer also has "local" (an in-process copy), but pool workers are separate processes.
    transport: Literal["grpc", "torch", "nixl"] = Field(
        default="grpc", description="'grpc', 'torch' (torch.distributed) or 'nixl' (NIXL WRITE from the KV pool over "
        "UCX; falls back to grpc where NIXL cannot be imported)")
    torch_backend: Literal["gloo", "nccl"] = Field(default="gloo", description="torch: 'gloo' (CPU) or 'nccl' (GPU)")
    deadline_s: float = Field(default=30.0, gt=0, description="a transfer not committed by then fails, freeing blocks")
    chunk_bytes: int = Field(default=1 << 20, ge=4096, le=64 << 20, description="grpc: bytes per chunk message")
    grpc_streams: int = Field(default=2, ge=1, le=16, description="grpc: parallel streams per transfer")
    host: str = Field(default="127.0.0.1", min_length=1,
                      description="address decode workers bind their KV port to and advertise to prefill workers; "
                      "'auto': each worker's own node IP")
    tls: bool = Field(default=False, description="mutual TLS on the KV gRPC plane with security.tls_cert_file/"
                      "tls_key_file (peers checked against security.tls_ca_file); torch's data ports stay cleartext")
    nixl_checksum: bool = Field(default=True, description="nixl: check every layer's blocks against the sender's "
                                "checksum before commit (false: trust the link's own CRC, e.g. NVLink/InfiniBand)")

    @field_validator("transport", mode="before")
    @classmethod
    def _no_local(cls, v: Any) -> Any:
        if v == "local":
            raise ValueError("'local' (in-process copy) is not offered: workers are separate processes; "
                             "use 'grpc', 'torch' or 'nixl'")
        return v

    def transfer_config(self, device: str, pools: frozenset[tuple[str, int]] = frozenset()) -> TransferConfig:
        """The kv_transfer settings for workers of a pool on `device` ('cpu' or 'cuda'); `pools`: the device and
        tensor_parallel_size of every pool of the cluster (none given: this pool, at TP 1)."""
        from kv_transfer.state import TransferConfig

        # NOTE: only nccl sends from CUDA; gloo's send/recv take CPU tensors, so it stays on the CPU for any pool.
        torch_device = device if self.torch_backend == "nccl" else "cpu"
        transport = _usable(self.transport)
        if transport == "nixl" and any(tp > 1 for _, tp in pools) and {device, *(d for d, _ in pools)} != {"cpu"}:
            transport = _copying(transport)
        return TransferConfig(transport=transport, deadline_s=self.deadline_s,
                              chunk_bytes=self.chunk_bytes, grpc_streams=self.grpc_streams,
                              torch_backend=self.torch_backend, torch_device=torch_device,
                              nixl_checksum=self.nixl_checksum)


@functools.cache
def _usable(transport: str) -> Any:
    """`transport`, or grpc where it cannot run here (nixl not importable), said once in the log."""
    from kv_transfer import transports

    why = transports.unavailable(transport)
    if why is None:
        return transport
    logging.getLogger(__name__).warning("transfer.transport: %s cannot run here (%s); KV moves over grpc", transport,
                                        why)
    return "grpc"


@functools.cache
def _copying(transport: str) -> Any:
    """grpc for a cluster with TP pools and a pool on CUDA, where `transport` (nixl) cannot reach or fill each rank's
    pool, said once.

    NOTE: NIXL writes each rank's KV heads from the pool of a sender rank holding them into the pool of every
    receiver rank holding them; rank 0 of a CPU group maps its followers' pools (engine/parallel/shared_pool.py),
    so CPU pools of any TP sizes keep it (where the two groups split the heads otherwise, the sender gathers them on
    the host: kv_transfer/transports/nixl_reshard.py). A group on CUDA keeps its followers' pools in their own
    processes, and a CUDA pool beside a CPU TP group would need that gather in GPU memory: such clusters move KV
    through the engine's copies (read_kv_layer and write_kv_blocks gather and scatter the ranks' heads) on a
    transport that sends copies. Every worker of the cluster takes it, so a nixl sender never meets a receiver
    whose pools it cannot fill.
    """
    logging.getLogger(__name__).warning("transfer.transport: %s writes each TP rank's KV pool on the host (a CPU "
                                        "group's rank 0 maps them all); with tensor-parallel pools and a pool on "
                                        "CUDA, KV moves over grpc", transport)
    return "grpc"


class AutoscalerConfig(BaseModel):
    """Pools sized while serving by the planner's simulator from the live traffic (pdcluster/autoscale.py)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(default=False, description="resize the prefill and decode pools from the live traffic")
    interval_s: float = Field(default=10.0, gt=0, description="seconds between two evaluations")
    window_s: float = Field(default=30.0, gt=0, description="the sliding window of traffic an evaluation reads")
    max_workers: int = Field(default=4, ge=2, description="prefill + decode workers at most")
    min_prefill: int = Field(default=1, ge=1, description="prefill workers at least")
    min_decode: int = Field(default=1, ge=1, description="decode workers at least")
    attainment: float = Field(default=0.9, gt=0, le=1, description="share of requests that must meet both "
                                                                   "router SLOs (slo_ttft_ms, slo_itl_ms as TPOT)")
    up_evaluations: int = Field(default=2, ge=1, description="evaluations in a row that must ask for more workers "
                                                             "before any pool grows")
    down_evaluations: int = Field(default=6, ge=1, description="evaluations in a row that must ask for fewer "
                                                               "workers before any pool shrinks (slower than up)")
    cooldown_s: float = Field(default=30.0, ge=0, description="no evaluation for this long after a change (the "
                                                              "window then shows the new pools)")
    min_requests: int = Field(default=8, ge=1, description="arrivals in the window below which nothing changes")
    profile: str | None = Field(default=None, min_length=1, description="a `plan profile` JSON whose step model "
                                "is scaled to the workers' measured step costs; null: the measured costs alone")

    @model_validator(mode="after")
    def _check(self) -> AutoscalerConfig:
        if self.min_prefill + self.min_decode > self.max_workers:
            raise _RuleError("max_workers", f"must be at least min_prefill + min_decode "
                                            f"({self.min_prefill + self.min_decode}), got {self.max_workers}")
        if self.down_evaluations < self.up_evaluations:
            raise _RuleError("down_evaluations", "must be at least up_evaluations (shrink slower than grow)")
        return self

