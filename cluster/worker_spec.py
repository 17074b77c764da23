"""How to build one worker: `WorkerSpec` (the launcher sends it to the worker's Ray actor) and its core-lending slot."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cluster.cores import LEND_MIN_PROMPT_TOKENS, CoreShare
from cluster.messages import Role
from cluster.redis_client import RedisAuth
from cluster.tracing import TracingSettings
from engine.config import EngineConfig
from kv_transfer.state import TransferConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """How to build one worker; the launcher sends it to the worker's Ray actor."""

    name: str  # also the Ray actor name, e.g. "prefill-0"
    role: Role
    model: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    redis_url: str | None = None  # None: no prefix index (unit tests)
    key_prefix: str = "pdc"
    kv_host: str = "127.0.0.1"  # decode/colocated: where the KV endpoint listens
    log_level: str = "INFO"
    log_format: str = "text"  # or "json"
    redis_auth: RedisAuth | None = None
    cpus: tuple[int, ...] = ()  # pin the actor's process to these cores (empty: not pinned)
    nice: int | None = None  # CPU priority of the actor's process (None: as Ray started it)
    served_model_name: str = ""  # the `model_name` label of this worker's metrics (empty: `model`)
    metrics_host: str = "127.0.0.1"  # where this worker's own /metrics listens
    metrics_port: int | None = None  # its port (0: a free one, advertised in the heartbeat); None: not served
    tracing: TracingSettings = field(default_factory=TracingSettings)
    cores_group: str = ""  # the node's core-lending file of this cluster (cluster/cores.py); empty: not shared
    lend_cores: bool = False  # step on idle peers' cores too (the pool's lend_idle_cores)
    lend_min_tokens: int = LEND_MIN_PROMPT_TOKENS  # ... only for steps with this many prompt tokens left to compute
    lora_modules: tuple[tuple[str, str], ...] = ()  # LoRA adapters (name, PEFT directory) loaded at start
    # TP > 1: the id (hex) of the worker's placement group; its TP ranks 1 .. n-1 are Ray actors in bundles 1 .. n-1
    # (cluster/tp_ranks.py). Empty: they are processes of the worker's (the engine's own launcher)
    placement_group: str = ""


def join_cores(spec: WorkerSpec) -> CoreShare | None:
    """This worker's slot in its node's core-lending file (cluster/cores.py); None when the cluster shares none."""
    if not spec.cores_group:
        return None
    share = CoreShare.join(spec.cores_group, spec.cpus, spec.engine.threads, lend=spec.lend_cores,
                           min_tokens=spec.lend_min_tokens)
    log.info("%s: core lending: slot %d, own cores %s, %d threads%s", spec.name, share.index,
             list(spec.cpus) or "all", spec.engine.threads, "; steps on idle peers' cores" if spec.lend_cores else "")
    return share

