"""A pool of workers in the deploy config: its actors (Ray resources, cores) and the engine each of them runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.cores import LEND_MIN_PROMPT_TOKENS
from pdcluster.config_rules import RuleError as _RuleError

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from pdcluster.config_lora import LoRAConfig


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
    tensor_parallel_size: int = Field(
        default=1, gt=0, description="ranks of each worker's engine (vLLM's name), one Ray actor each, all in the "
        "worker's placement group on one node; num_cpus, num_gpus and torch_threads are per rank (a worker of TP n "
        "reserves n times them)")
    num_cpus: float = Field(default=1.0, gt=0, description="Ray logical CPUs reserved per rank (per actor at TP 1)")
    num_gpus: float = Field(default=0.0, ge=0, description="GPUs reserved per rank (a fraction shares one GPU; "
                            "TP > 1 on cuda: 1)")
    resources: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="custom Ray resources per actor; {prefill_node: 1} pins it to such nodes")
    torch_threads: int = Field(default=1, gt=0, description="torch intra-op threads per rank (per actor at TP 1)")
    cpu_affinity: list[list[Annotated[int, Field(ge=0)]]] | Literal["auto"] | None = Field(
        default=None, description="cores per actor, all its ranks included (actor i: entry i mod len), e.g. [[0], "
        "[1]]; 'auto': cores of its own on this node (torch_threads x tensor_parallel_size), decode workers first, "
        "and the router kept off the decode workers' cores (pdcluster/core_plan.py; a private Ray only); null: not "
        "pinned")
    nice: int | None = Field(
        default=None, ge=-20, le=19, description="CPU priority of the actor's process (Linux nice: lower runs first; "
        "below the current value needs CAP_SYS_NICE); null: as Ray started it (0 in the private Ray of "
        "`pdcluster serve`, Ray's 15 in one started by `ray start`)")
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
        if isinstance(self.cpu_affinity, list) and not all(self.cpu_affinity):
            raise _RuleError("cpu_affinity", "each entry lists at least one core, e.g. [[0], [1]]")
        if "OMP_NUM_THREADS" in self.env_vars:
            raise _RuleError("env_vars", "OMP_NUM_THREADS: set torch_threads instead (the engine's pool size)")
        if self.tensor_parallel_size > 1:
            self._check_tp()
        reserved = sorted({"CPU", "GPU"} & set(self.resources))
        if reserved:
            # NOTE: Ray refuses CPU/GPU inside `resources`; they have their own fields here too.
            raise _RuleError("resources", f"{', '.join(reserved)}: use num_cpus / num_gpus instead")
        return self

    def _check_tp(self) -> None:
        """What a TP group's engine (engine/parallel/runner.py) would refuse at actor start, refused here instead."""
        n = self.tensor_parallel_size
        if self.device == "cuda" and self.num_gpus != 1:
            # NOTE: each rank's actor computes on the GPU of its bundle (cluster/tp_ranks.py), and NCCL cannot put
            # two ranks on one GPU: each bundle asks Ray for exactly one whole GPU
            raise _RuleError("num_gpus", f"is per rank: tensor_parallel_size {n} on cuda needs num_gpus 1 (the "
                                         f"worker reserves {n} GPUs of one node, one per rank), got {self.num_gpus:g}")
        if self.lend_idle_cores:
            # NOTE: the borrowed threads would be rank 0's only; its peers would wait for it at every all-reduce
            raise _RuleError("lend_idle_cores", f"lends cores to one process: tensor_parallel_size {n} runs {n}")

    def ray_resources(self) -> dict[str, float]:
        """What one worker of this pool reserves from Ray (at TP n its placement group's n bundles): num_cpus and
        num_gpus for each of its ranks, `resources` once (they mark nodes, e.g. {prefill_node: 1})."""
        n = self.tensor_parallel_size
        return {"CPU": self.num_cpus * n, "GPU": self.num_gpus * n, **self.resources}

    def cpus(self, index: int) -> tuple[int, ...]:
        """The cores actor `index` of this pool lists (empty: not pinned, or `auto`: pdcluster/core_plan.py)."""
        if not isinstance(self.cpu_affinity, list) or not self.cpu_affinity:
            return ()
        return tuple(self.cpu_affinity[index % len(self.cpu_affinity)])

    def engine_config(self, lora: LoRAConfig | None = None) -> EngineConfig:
        """The settings of the engine each actor of this pool runs (with `lora`'s adapter slots)."""
        # NOTE: imported here: engine pulls in torch, which a process that only reads the config never needs.
        from engine.config import EngineConfig, SpeculativeConfig

        spec = None if self.speculative_config is None else SpeculativeConfig(**self.speculative_config.model_dump())
        return EngineConfig(
            block_size=self.block_size, num_blocks=self.num_kv_blocks, kv_cache_memory_gb=self.kv_cache_memory_gb,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len, dtype=self.dtype, num_threads=self.torch_threads,
            prefill_order=self.prefill_order, quantization=self.quantization, kv_cache_dtype=self.kv_cache_dtype,
            speculative_config=spec, device=self.device, gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager, decode_lookahead=self.decode_lookahead,
            max_loras=lora.slots if lora else 0, max_lora_rank=lora.max_lora_rank if lora else 16,
            tensor_parallel_size=self.tensor_parallel_size)

    @property
    def resolved_dtype(self) -> str:
        """`dtype` with auto resolved for `device` (what the engine computes and stores KV in)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.device == "cuda" else "float32"



# the pool keys the prefill and decode pools must agree on (the KV they hand over, and the context it lives in)
KV_SHAPE_KEYS = ("dtype", "block_size", "kv_cache_dtype", "max_model_len")
