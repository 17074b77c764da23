"""The cluster's deploy config: pydantic models loaded from YAML, with errors that name the field and the line.

A file has one section per concern (`ray`, `redis`, `router`, `transfer`) and one per pool of workers (`prefill`,
`decode`, `colocated`); `mode` says which pools run. deploy/README.md lists the files and the schema.
`PDCLUSTER_<SECTION>__<FIELD>` environment variables override any field of the file (pdcluster/env.py).
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.cores import LEND_MIN_PROMPT_TOKENS
from cluster.messages import Role
from pdcluster import env
from pdcluster.router_config import RouterConfig
from pdcluster.yaml_source import ConfigError, ConfigIssue, line_of, parse

if TYPE_CHECKING:
    from cluster.tracing import TracingSettings
    from engine.config import EngineConfig
    from kv_transfer.state import TransferConfig

_RAY_ADDRESS = re.compile(r"^(ray://)?(\[[0-9a-fA-F:]+\]|[^\s:/\[\]]+):\d{1,5}$")


class _RuleError(ValueError):
    """A cross-field rule broken; `path` is relative to the model whose validator raised it."""

    def __init__(self, path: str, message: str) -> None:
        self.path = tuple(path.split("."))
        super().__init__(message)


class SpeculativeSection(BaseModel):
    """Speculative decoding of a pool's engine, in vLLM's keys (only n-gram prompt lookup)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram"] = Field(default="ngram", description="how drafts are proposed: n-gram prompt lookup")
    num_speculative_tokens: int = Field(default=4, gt=0, description="draft tokens verified per step")
    prompt_lookup_max: int = Field(default=4, gt=0, description="longest n-gram matched against the context")
    prompt_lookup_min: int = Field(default=1, gt=0, description="shortest n-gram tried")

    @model_validator(mode="after")
    def _check(self) -> SpeculativeSection:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise _RuleError("prompt_lookup_min", "must not exceed prompt_lookup_max")
        return self


class PoolConfig(BaseModel):
    """One pool of worker actors (prefill, decode or colocated) and the engine each of them runs."""

    model_config = ConfigDict(extra="forbid")

    replicas: int = Field(default=1, ge=0, description="actors in the pool; 0 only for a pool the mode does not run")
    num_cpus: float = Field(default=1.0, gt=0, description="Ray logical CPUs reserved per actor")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs reserved per actor (a fraction shares one GPU)")
    resources: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="custom Ray resources per actor; {prefill_node: 1} pins it to such nodes")
    torch_threads: int = Field(default=1, gt=0, description="torch intra-op threads per actor")
    cpu_affinity: list[list[Annotated[int, Field(ge=0)]]] | None = Field(
        default=None, description="cores per actor (actor i: entry i mod len), e.g. [[0], [1]]; null: not pinned")
    nice: int | None = Field(
        default=None, ge=-20, le=19, description="CPU priority of the actor's process (Linux nice: lower runs first; "
        "below the current value needs CAP_SYS_NICE); null: as Ray started it")
    env_vars: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], str] = Field(
        default_factory=dict, description="environment of the actor's process on top of the launcher's, e.g. "
        "{GOMP_SPINCOUNT: '0'}; OMP_NUM_THREADS comes from torch_threads")
    lend_idle_cores: bool = Field(
        default=False, description="cpu: step on the cores of this node's idle workers too, a torch thread per core, "
        "back to torch_threads / cpu_affinity at the next step once they have work (cluster/cores.py)")
    lend_min_prompt_tokens: int = Field(
        default=LEND_MIN_PROMPT_TOKENS, ge=0, description="lend_idle_cores: borrow only for a step with at least this "
        "many prompt tokens left to compute (shorter work ran slower on borrowed cores; 0: every step)")
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="where the actor computes ('cuda': num_gpus > 0)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="weights and KV dtype; auto: bfloat16 on cuda, float32 on cpu")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1, description="cuda: share of the GPU for weights + activations + KV (the KV pool "
        "gets what a profiling pass leaves); null: 0.9 on cuda; num_kv_blocks wins")
    enforce_eager: bool = Field(default=False, description="cuda: no CUDA graphs for decode steps")
    decode_lookahead: bool = Field(default=True, description="cuda graphs: launch the next decode step before this "
                                   "step's tokens reach the host (the GPU does not wait for scheduling)")
    num_kv_blocks: int | None = Field(default=None, gt=0, description="KV blocks; null: sized from kv_cache_memory_gb")
    kv_cache_memory_gb: float | None = Field(
        default=None, gt=0, description="KV cache size when num_kv_blocks is null; null: 1 GiB on cpu, and on cuda "
        "sized by gpu_memory_utilization (a set size wins there; not both)")
    block_size: int = Field(default=16, gt=0, description="tokens per KV block (the prefix-cache granularity)")
    max_num_batched_tokens: int = Field(default=1024, gt=0, description="tokens computed per engine step at most")
    max_num_seqs: int = Field(default=64, gt=0, description="sequences in one batch at most")
    prefill_order: Literal["fcfs", "shortest_first"] = Field(
        default="fcfs", description="order of prompt work in a step; shortest_first lets short prompts overtake")
    max_model_len: int | None = Field(default=None, gt=0, description="prompt + output tokens; null: the model's")
    max_restarts: int = Field(default=0, ge=-1, description="times Ray restarts a dead actor (-1: forever)")
    quantization: Literal["int8"] | None = Field(
        default=None, description="weight-only quantization of the linear layers; null: dtype")
    kv_cache_dtype: Literal["auto", "int8"] = Field(
        default="auto", description="KV cache storage; prefill and decode pools must agree (the transfer checks)")
    speculative_config: SpeculativeSection | None = Field(
        default=None, description="speculative decoding, e.g. {method: ngram, num_speculative_tokens: 4}")

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if self.device == "cuda" and self.num_gpus <= 0:
            raise _RuleError("num_gpus", "device 'cuda' needs num_gpus > 0 (Ray must reserve a GPU for the actor)")
        if self.lend_idle_cores and self.device == "cuda":
            # NOTE: a GPU step's compute is not torch's CPU threads: more of them would only take cores from peers
            raise _RuleError("lend_idle_cores", "lends CPU cores to CPU workers: device 'cuda' computes on its GPU")
        if self.gpu_memory_utilization is not None and self.kv_cache_memory_gb is not None:
            raise _RuleError("kv_cache_memory_gb", "and gpu_memory_utilization both size the KV pool: set one")
        if self.gpu_memory_utilization is not None and self.device != "cuda":
            raise _RuleError("gpu_memory_utilization", "sizes a GPU's KV pool: needs device 'cuda' (on the CPU use "
                                                       "kv_cache_memory_gb or num_kv_blocks)")
        if self.cpu_affinity is not None and not all(self.cpu_affinity):
            raise _RuleError("cpu_affinity", "each entry lists at least one core, e.g. [[0], [1]]")
        if "OMP_NUM_THREADS" in self.env_vars:
            raise _RuleError("env_vars", "OMP_NUM_THREADS: set torch_threads instead (the engine's pool size)")
        reserved = sorted({"CPU", "GPU"} & set(self.resources))
        if reserved:
            # NOTE: Ray refuses CPU/GPU inside `resources`; they have their own fields here too.
            raise _RuleError("resources", f"{', '.join(reserved)}: use num_cpus / num_gpus instead")
        return self

    def cpus(self, index: int) -> tuple[int, ...]:
        """The cores actor `index` of this pool is pinned to (empty: not pinned)."""
        if not self.cpu_affinity:
            return ()
        return tuple(self.cpu_affinity[index % len(self.cpu_affinity)])

    def engine_config(self) -> EngineConfig:
        """The settings of the engine each actor of this pool runs."""
        # NOTE: imported here: engine pulls in torch, which a process that only reads the config never needs.
        from engine.config import EngineConfig, SpeculativeConfig

        spec = None if self.speculative_config is None else SpeculativeConfig(**self.speculative_config.model_dump())
        return EngineConfig(
            block_size=self.block_size, num_blocks=self.num_kv_blocks, kv_cache_memory_gb=self.kv_cache_memory_gb,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, dtype=self.dtype, num_threads=self.torch_threads,
            prefill_order=self.prefill_order, quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
            speculative_config=spec, device=self.device, gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager, decode_lookahead=self.decode_lookahead)

    @property
    def resolved_dtype(self) -> str:
        """`dtype` with auto resolved for `device` (what the engine computes and stores KV in)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"


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

    def transfer_config(self, device: str) -> TransferConfig:
        """The kv_transfer settings for workers of a pool on `device` ('cpu' or 'cuda')."""
        from kv_transfer.state import TransferConfig

        # NOTE: only nccl sends from CUDA; gloo's send/recv take CPU tensors, so it stays on the CPU for any pool.
        torch_device = device if self.torch_backend == "nccl" else "cpu"
        return TransferConfig(transport=_usable(self.transport), deadline_s=self.deadline_s,
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


# the pool keys the prefill and decode pools must agree on (the KV they hand over, and the context it lives in)
KV_SHAPE_KEYS = ("dtype", "block_size", "kv_cache_dtype", "max_model_len")


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


class ClusterConfig(BaseModel):
    """A whole deployment: model, mode, Ray, Redis, router, KV transfer and the worker pools."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(default="smollm2", min_length=1, description="'smollm2', 'tiny', 'random:<arch>' (random "
                       "weights of a real shape: random:llama-3.1-8b, random:qwen2.5-7b, random:smollm2-135m), a .gguf "
                       "file or a Hugging Face directory (same path on every node)")
    mode: Literal["disaggregated", "colocated"] = Field(
        default="disaggregated", description="'disaggregated': prefill and decode pools; 'colocated': one pool")
    # NOTE: pydantic copies a model default for each instance, so two configs never share a section.
    ray: RayConfig = RayConfig()
    redis: RedisConfig = RedisConfig()
    router: RouterConfig = RouterConfig()
    transfer: TransferSection = TransferSection()
    http: HttpConfig = HttpConfig()
    metrics: MetricsConfig = MetricsConfig()
    tracing: TracingConfig = TracingConfig()
    security: SecurityConfig = SecurityConfig()
    logging: LoggingConfig = LoggingConfig()
    autoscaler: AutoscalerConfig = AutoscalerConfig()
    prefill: PoolConfig = Field(default=PoolConfig(), description="disaggregated mode: the prompt workers")
    decode: PoolConfig = Field(default=PoolConfig(), description="disaggregated mode: the token workers")
    colocated: PoolConfig = Field(default=PoolConfig(replicas=0), description="colocated mode: the only workers")

    @model_validator(mode="before")
    @classmethod
    def _empty_sections_are_defaults(cls, data: Any) -> Any:
        # NOTE: a section whose keys are all commented out parses as null; it means "the defaults", not an error.
        if not isinstance(data, dict):
            return data
        sections = {name for name, f in cls.model_fields.items()
                    if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}
        return {k: {} if v is None and k in sections else v for k, v in data.items()}

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        for name in self.pools():
            if getattr(self, name).replicas < 1:
                raise _RuleError(f"{name}.replicas", f"mode {self.mode!r} runs the {name} pool: needs >= 1 replica")
        if self.ray.keep_workers and self.security.cluster_token_env is None:
            # NOTE: the next `serve` re-attaches only to workers that prove its token; a random one per start
            # would never match
            raise _RuleError("ray.keep_workers", "kept workers are re-attached by a later `serve` only if they prove "
                                                 "its cluster token: set security.cluster_token_env")
        if self.transfer.tls and self.transfer.transport == "nixl":
            raise _RuleError("transfer.tls", "NIXL does not encrypt: transfer.tls needs transfer.transport 'grpc', "
                                             "not 'nixl'")
        if self.transfer.tls and self.security.tls_cert_file is None:
            raise _RuleError("transfer.tls", "KV TLS uses the cluster's certificate: set security.tls_cert_file "
                                             "and security.tls_key_file")
        # NOTE: colocated workers never transfer KV, so the transfer section only binds in disaggregated mode.
        if self.mode == "disaggregated" and self.transfer.torch_backend == "nccl":
            if self.transfer.transport != "torch":
                raise _RuleError("transfer.torch_backend", f"'nccl' needs transport 'torch', "
                                                           f"not {self.transfer.transport!r}")
            cpu_pools = [f"{name}.device" for name in ("prefill", "decode") if getattr(self, name).device != "cuda"]
            if cpu_pools:
                raise _RuleError("transfer.torch_backend", f"'nccl' sends CUDA tensors: {' and '.join(cpu_pools)} "
                                                           "must be 'cuda' (or use torch_backend 'gloo')")
            share = self.prefill.num_gpus + self.decode.num_gpus
            if share <= 1:
                # NOTE: Ray packs fractional GPUs onto one device, and NCCL cannot pair two ranks on one device
                # (the torch transport refuses that pair at run time too: kv_transfer/transports/torch_pairs.py)
                raise _RuleError("transfer.torch_backend", f"'nccl' cannot pair two ranks on one GPU, and "
                                 f"prefill.num_gpus + decode.num_gpus = {share:g} lets Ray put a prefill and a decode "
                                 "worker on the same GPU: give each a whole GPU (num_gpus: 1), or use "
                                 "transfer.transport 'nixl' (CUDA IPC between processes of one GPU)")
        if self.mode == "disaggregated":
            self._check_pools_agree()
        if self.autoscaler.enabled:
            self._check_autoscaler()
        return self

    def _check_autoscaler(self) -> None:
        a = self.autoscaler
        # NOTE: the planner sizes a prefill:decode split; a colocated cluster has one pool to size, which the
        # autoscaler does not do (yet): refused rather than ignored
        if self.mode != "disaggregated":
            raise _RuleError("autoscaler.enabled", "needs mode 'disaggregated' (it sizes the prefill:decode split)")
        start = self.prefill.replicas + self.decode.replicas
        if start > a.max_workers:
            raise _RuleError("autoscaler.max_workers", f"the pools start with {start} workers (prefill.replicas + "
                                                       f"decode.replicas), more than max_workers {a.max_workers}")
        for pool, least in (("prefill", a.min_prefill), ("decode", a.min_decode)):
            if getattr(self, pool).replicas < least:
                raise _RuleError(f"{pool}.replicas", f"below autoscaler.min_{pool} ({least})")

    def _check_pools_agree(self) -> None:
        # NOTE: the decode worker takes the prefill worker's KV as it is: pools that disagree on the KV's shape or
        # dtype fail every Prepare (and each request then prefills on the decode worker), and on max_model_len the
        # router admits prompts by one pool's limit that the other refuses. Refused here, before any actor starts.
        for key in KV_SHAPE_KEYS:
            attr = "resolved_dtype" if key == "dtype" else key  # NOTE: auto is bfloat16 on cuda, float32 on cpu
            p, d = getattr(self.prefill, attr), getattr(self.decode, attr)
            if p != d:
                raise _RuleError(f"decode.{key}", f"prefill.{key} is {p!r} but decode.{key} is {d!r}: the prefill "
                                                  "and decode pools must agree (KV moves between them as it is)")

    @property
    def served_model_name(self) -> str:
        """The model id clients pass (OpenAI `model`, metrics' `model_name`): `http.served_model_name` or `model`."""
        return self.http.served_model_name or self.model

    def pools(self) -> dict[Role, PoolConfig]:
        """The pools this mode runs, by role: prefill and decode, or colocated."""
        if self.mode == "colocated":
            return {Role.COLOCATED: self.colocated}
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode}

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> ClusterConfig:
        """Load and validate a YAML file; every problem is a ConfigError naming the field and the line."""
        source = os.fspath(path)
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigError(source, [ConfigIssue("", None, f"no such file ({os.path.abspath(source)})")]) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(source, [ConfigIssue("", None, f"cannot read: {exc}")]) from None
        return cls.from_yaml_text(text, source)

    @classmethod
    def from_data(cls, data: dict[str, Any], source: str) -> ClusterConfig:
        """Validate a config as a dict (e.g. one changed by command-line flags); errors name `source`."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(source, [_issue(err, None) for err in exc.errors()]) from None

    @classmethod
    def from_yaml_text(cls, text: str, source: str = "<string>") -> ClusterConfig:
        """Validate YAML text with the PDCLUSTER_* environment laid over it; `source` names it in error messages.

        Empty text gives the defaults.
        """
        node, data = parse(text, source)
        overrides = env.overrides(cls)
        try:
            return cls.model_validate(env.merge(data, overrides) if overrides else {} if data is None else data)
        except ValidationError as exc:
            raise ConfigError(source, [_issue(err, node, overrides) for err in exc.errors()]) from None


def _issue(err: Any, root: yaml.Node | None, overrides: dict[str, Any] | None = None) -> ConfigIssue:
    """A pydantic error as a ConfigIssue: its dotted path and the line of the deepest YAML node on that path."""
    loc: tuple[str | int, ...] = tuple(err["loc"])
    set_by: Any = overrides or None
    for part in loc:
        set_by = set_by.get(part) if isinstance(set_by, dict) else None
    if loc and set_by is not None:  # NOTE: the environment set it: name the variable, not a line of the file
        return ConfigIssue(".".join(map(str, loc)), None,
                           f"{_issue(err, None).message} (from {env.variable_of('.'.join(map(str, loc)))})")
    message = err["msg"]
    cause = err.get("ctx", {}).get("error")
    if isinstance(cause, _RuleError):
        loc, message = loc + cause.path, str(cause)
    elif isinstance(cause, ValueError):
        message = str(cause)  # without pydantic's "Value error, " prefix
    elif err["type"] == "extra_forbidden":
        message = _unknown_key_message(loc)
    return ConfigIssue(".".join(map(str, loc)), line_of(root, loc), message)


def _unknown_key_message(loc: tuple[str | int, ...]) -> str:
    """'unknown key', with the closest valid key or the list of valid keys of the section it is in."""
    model: type[BaseModel] = ClusterConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return "unknown key"
        model = field.annotation
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    if close:
        return f"unknown key; did you mean {close[0]!r}?"
    return f"unknown key; valid keys: {', '.join(model.model_fields)}"
