"""The cluster's deploy config: pydantic models loaded from YAML, with errors that name the field and the line.

A file has one section per concern (`ray`, `redis`, `router`, `transfer`) and one per pool of workers (`prefill`,
`decode`, `colocated`); `mode` says which pools run. deploy/README.md lists the files and the schema.
`PDCLUSTER_<SECTION>__<FIELD>` environment variables override any field of the file (pdcluster/env.py).
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.messages import Role
from pdcluster import env
from pdcluster.config_lora import LoRAConfig
from pdcluster.config_pool import KV_SHAPE_KEYS, PoolConfig, SpeculativeSection
from pdcluster.config_rules import RuleError as _RuleError
from pdcluster.config_sections import (
    AutoscalerConfig,
    HttpConfig,
    LoggingConfig,
    MetricsConfig,
    RayConfig,
    RedisConfig,
    SecurityConfig,
    TracingConfig,
    TransferSection,
)
from pdcluster.router_config import RouterConfig
from pdcluster.yaml_source import ConfigError, ConfigIssue, line_of, parse

__all__ = ["KV_SHAPE_KEYS", "AutoscalerConfig", "ClusterConfig", "ConfigError", "HttpConfig", "LoRAConfig",
           "LoggingConfig", "MetricsConfig", "PoolConfig", "RayConfig", "RedisConfig", "SecurityConfig",
           "SpeculativeSection", "TracingConfig", "TransferSection"]


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
    lora: LoRAConfig = LoRAConfig()
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
        if self.served_model_name in self.lora.modules:
            # NOTE: a request's `model` names either the base model or an adapter: one name cannot be both
            raise _RuleError(f"lora.modules.{self.served_model_name}", "is the base model's name (http."
                             "served_model_name or model): give the adapter another name")
        if self.autoscaler.enabled:
            self._check_autoscaler()
        tp = {name: pool.tensor_parallel_size for name, pool in self.pools().items() if pool.tensor_parallel_size > 1}
        if tp:
            self._check_tensor_parallel(tp)
        return self

    def _check_tensor_parallel(self, tp: dict[Role, int]) -> None:
        """What a TP group's engine refuses at actor start, refused here: a size the model's heads cannot be split
        by (when the model's shape can be read here: an alias or a Hugging Face directory)."""
        # NOTE: imported here, and only for TP > 1: engine pulls in torch, which most config readers never need
        from engine.errors import EngineError
        from engine.loader import model_shape
        from engine.parallel import check_tp

        try:
            shape = model_shape(self.model)
        except EngineError as e:
            raise _RuleError("model", str(e)) from None
        if shape is None:
            return
        for name, n in tp.items():
            try:
                check_tp(shape, n)
            except EngineError as e:  # NOTE: its message starts with the engine's field name, which the path has
                raise _RuleError(f"{name}.tensor_parallel_size", e.reason.removeprefix("tensor_parallel_size: ")) \
                    from None

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


_UNION_TAG = re.compile(r"[a-z-]+\[.*\]|constrained-[a-z]+")


def _issue(err: Any, root: yaml.Node | None, overrides: dict[str, Any] | None = None) -> ConfigIssue:
    """A pydantic error as a ConfigIssue: its dotted path and the line of the deepest YAML node on that path."""
    # NOTE: without the member tags pydantic puts in the path of a union's error ("list[list[constrained-int]]" in
    # prefill.cpu_affinity.list[list[constrained-int]].0.0): no YAML key looks like one
    loc: tuple[str | int, ...] = tuple(p for p in err["loc"] if not (isinstance(p, str) and _UNION_TAG.fullmatch(p)))
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
