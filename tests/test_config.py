"""The deploy config: every file in deploy/ loads, and a bad file is refused naming the field and its line."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from engine.config import EngineConfig
from kv_transfer.state import TransferConfig
from pdcluster.config import ClusterConfig, ConfigError, PoolConfig, TransferSection

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# NOTE: deploy/ also holds manifests for other tools (KubeRay, `ray up`); those are checked in test_deploy_manifests.
OTHER_TOOLS = ("kuberay-", "ray-cluster-")
DEPLOY_FILES = sorted(f for f in glob.glob(os.path.join(REPO, "deploy", "*.yaml"))
                      if not os.path.basename(f).startswith(OTHER_TOOLS))


def lines(*rows: str) -> str:
    """YAML text whose line N is the N-th argument (so the tests can name lines)."""
    return "\n".join(rows) + "\n"


# ---- the files in deploy/ ---------------------------------------------------------------------------------------

def test_deploy_has_the_documented_files():
    names = {os.path.basename(p) for p in DEPLOY_FILES}
    assert {"local.yaml", "local-2p1d.yaml", "local-colocated.yaml", "gpu-cluster.yaml"} <= names


@pytest.mark.parametrize("path", DEPLOY_FILES, ids=os.path.basename)
def test_every_deploy_file_loads_and_runs_pools(path):
    cfg = ClusterConfig.from_yaml(path)
    pools = cfg.pools()
    assert pools and all(p.replicas >= 1 for p in pools.values())
    for pool in pools.values():
        assert isinstance(pool.engine_config(), EngineConfig)
        assert isinstance(cfg.transfer.transfer_config(pool.device), TransferConfig)


def test_serving_falls_back_to_grpc_with_one_log_line_where_nixl_cannot_be_imported():
    code = ("import logging, sys\n"
            "for name in ('nixl_cu13', 'nixl_cu12', 'nixl'): sys.modules[name] = None  # NOTE: no NIXL installed\n"
            "logging.basicConfig(format='%(levelname)s %(message)s')\n"
            "from pdcluster.config import ClusterConfig\n"
            "transfer = ClusterConfig.from_yaml('deploy/local.yaml').transfer\n"
            "used = [transfer.transfer_config(device).transport for device in ('cpu', 'cpu')]\n"
            "print(transfer.transport, *used)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["nixl", "grpc", "grpc"]
    said = [line for line in done.stderr.splitlines() if "transfer.transport" in line]
    assert len(said) == 1 and "nixl cannot run here" in said[0] and "grpc" in said[0], done.stderr


def test_local_yaml_is_the_embedded_laptop_default():
    cfg = ClusterConfig.from_yaml(os.path.join(REPO, "deploy", "local.yaml"))
    assert cfg.mode == "disaggregated" and cfg.model == "smollm2"
    assert (cfg.prefill.replicas, cfg.decode.replicas) == (1, 1)
    assert cfg.ray.address == "local" and cfg.redis.url is None
    assert cfg.transfer.transport == "nixl"
    assert (cfg.router.host, cfg.router.port) == ("127.0.0.1", 50051)
    for pool in (cfg.prefill, cfg.decode):
        assert (pool.num_cpus, pool.torch_threads) == (1, 1)
        assert (pool.num_kv_blocks, pool.max_num_batched_tokens) == (2048, 1024)
    assert set(cfg.pools()) == {"prefill", "decode"}


def test_other_deploy_files_hold_their_documented_shapes():
    two_one = ClusterConfig.from_yaml(os.path.join(REPO, "deploy", "local-2p1d.yaml"))
    assert (two_one.prefill.replicas, two_one.decode.replicas, two_one.router.port) == (2, 1, 0)
    assert two_one.prefill.num_cpus == two_one.decode.num_cpus == 0.5
    colo = ClusterConfig.from_yaml(os.path.join(REPO, "deploy", "local-colocated.yaml"))
    assert colo.mode == "colocated" and set(colo.pools()) == {"colocated"} and colo.colocated.replicas == 2
    gpu = ClusterConfig.from_yaml(os.path.join(REPO, "deploy", "gpu-cluster.yaml"))
    assert gpu.ray.address == "auto" and gpu.redis.url == "redis://redis.internal:6379/0"
    assert (gpu.transfer.transport, gpu.transfer.torch_backend) == ("torch", "nccl")
    assert gpu.prefill.resources == {"prefill_node": 1} and gpu.decode.resources == {"decode_node": 1}
    assert gpu.prefill.device == gpu.decode.device == "cuda" and gpu.prefill.max_restarts == 3


# ---- loading ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n", "null\n"], ids=["empty", "comment", "doc", "null"])
def test_empty_file_gives_the_defaults(text):
    assert ClusterConfig.from_yaml_text(text) == ClusterConfig()


def test_a_section_with_every_key_commented_out_takes_its_defaults():
    cfg = ClusterConfig.from_yaml_text(lines("redis:", "  # url: redis://x:6379/0", "prefill:"))
    assert cfg.redis == ClusterConfig().redis and cfg.prefill == PoolConfig()


def test_colocated_mode_runs_only_the_colocated_pool_and_ignores_the_others():
    cfg = ClusterConfig.from_yaml_text(lines("mode: colocated", "colocated:", "  replicas: 3", "prefill:",
                                             "  replicas: 0"))
    assert set(cfg.pools()) == {"colocated"} and cfg.pools()["colocated"].replicas == 3


def test_from_yaml_on_a_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_yaml(path)
    assert str(path) in str(info.value) and "no such file" in str(info.value)
    assert info.value.source == str(path) and info.value.line is None


def test_from_yaml_reads_a_file_and_names_it_in_errors(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(lines("mode: disaggregated", "prefill:", "  replicas: 2"))
    assert ClusterConfig.from_yaml(path).prefill.replicas == 2
    path.write_text(lines("mode: disaggregated", "prefill:", "  replicas: -1"))
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_yaml(str(path))
    assert str(info.value) == f"{path}:3: prefill.replicas: Input should be greater than or equal to 0"


# ---- bad files: (yaml, path, line, words in the message) -------------------------------------------------------

BAD = {
    "unknown top-level key": (lines("model: smollm2", "moed: colocated"), "moed", 2, ["unknown key", "'mode'"]),
    "unknown nested key": (lines("prefill:", "  replicas: 1", "  replicaz: 2"), "prefill.replicaz", 3,
                           ["unknown key", "'replicas'"]),
    "unknown key, nothing close": (lines("router:", "  port: 1", "  zzz: 1"), "router.zzz", 3, ["max_inflight"]),
    "wrong type": (lines("decode:", "  num_kv_blocks: many"), "decode.num_kv_blocks", 2, ["valid integer"]),
    "section not a mapping": (lines("model: tiny", "ray: 3"), "ray", 2, ["RayConfig"]),
    "negative replicas": (lines("prefill:", "  num_cpus: 1", "  replicas: -1"), "prefill.replicas", 3,
                          ["greater than or equal to 0"]),
    "zero cpus": (lines("decode:", "  num_cpus: 0"), "decode.num_cpus", 2, ["greater than 0"]),
    "transport local": (lines("transfer:", "  transport: local"), "transfer.transport", 2, ["separate processes"]),
    "transport carrier-pigeon": (lines("transfer:", "  transport: carrier-pigeon"), "transfer.transport", 2,
                                 ["'grpc', 'torch' or 'nixl'"]),
    "bad dtype": (lines("prefill:", "  dtype: fp8"), "prefill.dtype", 2, ["'bfloat16'"]),
    "nccl over grpc": (lines("transfer:", "  torch_backend: nccl"), "transfer.torch_backend", 2, ["transport 'torch'"]),
    "tls over nixl": (lines("transfer:", "  transport: nixl", "  tls: true"), "transfer.tls", 3, ["'nixl'"]),
    "nccl with cpu pools": (lines("transfer:", "  transport: torch", "  torch_backend: nccl"),
                            "transfer.torch_backend", 3, ["prefill.device and decode.device", "'cuda'"]),
    "nccl with one cpu pool": (lines("transfer: {transport: torch, torch_backend: nccl}",
                                     "prefill: {device: cuda, num_gpus: 1}"),
                               "transfer.torch_backend", 1, ["decode.device must"]),
    "cuda without gpus": (lines("model: tiny", "decode:", "  device: cuda"), "decode.num_gpus", 2, ["num_gpus > 0"]),
    "CPU in resources": (lines("prefill:", "  resources:", "    CPU: 2"), "prefill.resources", 2, ["num_cpus"]),
    "negative resource": (lines("prefill:", "  resources:", "    prefill_node: -1"),
                          "prefill.resources.prefill_node", 3, ["greater than 0"]),
    "colocated with 0 replicas": (lines("mode: colocated", "colocated:", "  replicas: 0"), "colocated.replicas", 3,
                                  [">= 1"]),
    "colocated section missing": (lines("mode: colocated"), "colocated.replicas", 1, [">= 1"]),
    "disaggregated with 0 decode": (lines("decode:", "  replicas: 0"), "decode.replicas", 2, [">= 1"]),
    "ray.num_cpus with address auto": (lines("ray:", "  address: auto", "  num_cpus: 4"), "ray.num_cpus", 3,
                                       ["address 'local'"]),
    "bad ray address": (lines("ray:", "  address: somewhere"), "ray.address", 2, ["'auto'"]),
    "empty core list": (lines("decode:", "  cpu_affinity: [[0], []]"), "decode.cpu_affinity", 2, ["at least one core"]),
    "negative core": (lines("prefill:", "  cpu_affinity: [[-1]]"), "prefill.cpu_affinity.0.0", 2,
                      ["greater than or equal to 0"]),
    "nice out of range": (lines("prefill:", "  nice: 20"), "prefill.nice", 2, ["less than or equal to 19"]),
    "OMP_NUM_THREADS in env_vars": (lines("decode:", "  env_vars: {OMP_NUM_THREADS: '4'}"), "decode.env_vars", 2,
                                    ["torch_threads"]),
    "bad env var name": (lines("decode:", "  env_vars: {'A B': '1'}"), "decode.env_vars.A B.[key]", 2, ["pattern"]),
    "unknown prefill order": (lines("prefill:", "  prefill_order: lifo"), "prefill.prefill_order", 2, ["fcfs"]),
    "bad redis scheme": (lines("redis:", "  url: http://redis:6379"), "redis.url", 2, ["redis://"]),
    "key_prefix with a space": (lines("redis:", "  key_prefix: my prefix"), "redis.key_prefix", 2, ["pattern"]),
    "port out of range": (lines("router:", "  host: 0.0.0.0", "  port: 70000"), "router.port", 3, ["65535"]),
    "chunk too small": (lines("transfer:", "  chunk_bytes: 100"), "transfer.chunk_bytes", 2, ["4096"]),
    "duplicate section": (lines("prefill:", "  replicas: 1", "decode: {}", "prefill:", "  replicas: 2"), "prefill",
                          4, ["duplicate key", "line 1"]),
    "syntax error": (lines("prefill:", "  replicas: 1", " decode: [1, 2"), "", 3, ["invalid YAML"]),
    "unclosed flow": (lines("prefill: {replicas: 1", "decode:", "  replicas: 1"), "", 2, ["invalid YAML"]),
    "top level a list": (lines("- prefill", "- decode"), "", 1, ["mapping"]),
    "top level a scalar": (lines("smollm2"), "", 1, ["mapping"]),
    "python tag refused": (lines("model: !!python/object/apply:os.system ['true']"), "", 1, ["invalid YAML"]),
    "two documents": (lines("model: tiny", "---", "model: smollm2"), "", 2, ["invalid YAML"]),
    "more adapters than slots": (lines("lora:", "  modules: {a: /x, b: /y}", "  max_loras: 1"), "lora.max_loras", 3,
                                 ["modules lists 2"]),
    "adapter named as the base": (lines("model: tiny", "lora:", "  modules:", "    tiny: /x"), "lora.modules.tiny", 4,
                                  ["base model's name"]),
    "adapter name with a space": (lines("lora:", "  modules: {'my adapter': /x}"), "lora.modules.my adapter.[key]",
                                  2, ["pattern"]),
    "unknown lora key": (lines("lora:", "  lora_modules: {a: /x}"), "lora.lora_modules", 2, ["'modules'"]),
    "zero lora rank": (lines("lora:", "  max_lora_rank: 0"), "lora.max_lora_rank", 2, ["greater than 0"]),
    # tensor parallelism: what the TP engine would refuse at actor start, refused with the file
    "tp not dividing the heads": (lines("model: tiny", "prefill:", "  tensor_parallel_size: 3"),
                                  "prefill.tensor_parallel_size", 3, ["3 must divide", "4 attention heads"]),
    "tp of smollm2's 9 heads": (lines("model: smollm2", "decode:", "  tensor_parallel_size: 2"),
                                "decode.tensor_parallel_size", 3, ["9 attention heads"]),
    "tp zero": (lines("decode:", "  tensor_parallel_size: 0"), "decode.tensor_parallel_size", 2, ["greater than 0"]),
    "tp on cuda with gpus per actor": (lines("model: tiny", "prefill:", "  device: cuda", "  num_gpus: 2",
                                             "  kv_cache_memory_gb: 1", "  tensor_parallel_size: 2"),
                                       "prefill.num_gpus", 4, ["per rank", "num_gpus 1"]),
    "tp lending cores": (lines("model: tiny", "decode:", "  tensor_parallel_size: 2", "  lend_idle_cores: true"),
                         "decode.lend_idle_cores", 4, ["runs 2"]),
}


@pytest.mark.parametrize("text,path,line,words", BAD.values(), ids=BAD.keys())
def test_bad_yaml_names_the_field_and_the_line(text, path, line, words):
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_yaml_text(text, "deploy/x.yaml")
    err = info.value
    assert (err.path, err.line, err.source) == (path, line, "deploy/x.yaml")
    message = str(err)
    assert message.startswith(f"deploy/x.yaml:{line}: " + (f"{path}: " if path else ""))
    for word in words:
        assert word in message


def test_several_errors_are_one_config_error_listing_each_on_its_own_line_in_file_order():
    text = lines("router:", "  port: -5", "prefill:", "  replicas: -1", "  bogus: 1")
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_yaml_text(text, "x.yaml")
    err = info.value
    assert (err.path, err.line) == ("router.port", 2)
    assert [(i.path, i.line) for i in err.issues] == [("router.port", 2), ("prefill.replicas", 4),
                                                        ("prefill.bogus", 5)]
    rows = str(err).splitlines()
    assert [r.split(": ")[0:2] for r in rows] == [["x.yaml:2", "router.port"], ["x.yaml:4", "prefill.replicas"],
                                                  ["x.yaml:5", "prefill.bogus"]]


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        ClusterConfig.from_yaml_text("mode: sideways\n")


# ---- what the sections build -----------------------------------------------------------------------------------

def test_engine_config_maps_the_pool_fields():
    pool = PoolConfig(num_kv_blocks=300, block_size=32, max_num_batched_tokens=512, max_num_seqs=8,
                      max_model_len=4096, dtype="bfloat16", torch_threads=3, kv_cache_memory_gb=2.5)
    ec = pool.engine_config()
    assert (ec.num_blocks, ec.block_size, ec.max_num_batched_tokens, ec.max_num_seqs) == (300, 32, 512, 8)
    assert (ec.max_model_len, ec.dtype, ec.num_threads, ec.kv_cache_memory_gb) == (4096, "bfloat16", 3, 2.5)
    assert PoolConfig().engine_config().num_blocks is None  # sized from kv_cache_memory_gb


def test_tensor_parallel_size_reaches_the_engine_and_counts_the_ranks_resources():
    cfg = ClusterConfig.from_yaml_text(lines(
        "model: random:llama-3.1-70b",
        "prefill: {tensor_parallel_size: 8, device: cuda, num_gpus: 1, num_cpus: 2, kv_cache_memory_gb: 40, "
        "resources: {prefill_node: 1}}",
        "decode: {num_cpus: 3, dtype: bfloat16}"))
    assert cfg.prefill.engine_config().tensor_parallel_size == 8
    assert cfg.decode.engine_config().tensor_parallel_size == 1  # the default
    # NOTE: num_cpus and num_gpus are per rank; custom resources mark the node, once per actor
    assert cfg.prefill.ray_resources() == {"CPU": 16.0, "GPU": 8.0, "prefill_node": 1}
    assert cfg.decode.ray_resources() == {"CPU": 3.0, "GPU": 0.0}


def test_a_model_not_on_this_machine_skips_the_head_check():
    # NOTE: a gguf or a directory of another node: the engine checks the heads at actor start
    cfg = ClusterConfig.from_yaml_text(lines("model: /models/elsewhere", "prefill: {tensor_parallel_size: 3}"))
    assert cfg.prefill.tensor_parallel_size == 3


def test_lora_section_sizes_every_pool_and_lists_its_modules():
    cfg = ClusterConfig.from_yaml_text(lines("lora:", "  modules: {sql: /a/sql, chat: /a/chat}", "  max_lora_rank: 8"))
    assert cfg.lora.slots == 2 and cfg.lora.modules == {"sql": "/a/sql", "chat": "/a/chat"}
    assert ClusterConfig().lora.slots == 0  # NOTE: no adapters: the engines carry no LoRA slots
    assert ClusterConfig.from_yaml_text(lines("lora:", "  max_loras: 4")).lora.slots == 4


def test_lora_modules_lacking_peft_files_are_named_before_anything_starts(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapter_config.json").write_text("{}")
    cfg = ClusterConfig.from_yaml_text(lines("lora:", f"  modules: {{half: {tmp_path / 'half'}, gone: /no/such}}"))
    assert cfg.lora.missing_files() == [
        f"lora.modules.half: {tmp_path / 'half'} lacks adapter_model.safetensors (a PEFT adapter directory holds "
        "adapter_config.json and adapter_model.safetensors)",
        "lora.modules.gone: /no/such lacks adapter_config.json and adapter_model.safetensors (a PEFT adapter "
        "directory holds adapter_config.json and adapter_model.safetensors)"]


def test_cpu_affinity_cycles_over_the_actors_and_prefill_order_reaches_the_engine():
    pool = PoolConfig(replicas=3, cpu_affinity=[[0], [1, 2]], prefill_order="shortest_first")
    assert [pool.cpus(i) for i in range(3)] == [(0,), (1, 2), (0,)]
    assert PoolConfig().cpus(0) == ()
    assert pool.engine_config().prefill_order == "shortest_first"


def test_pinning_an_actor_process_to_a_core_it_lacks_names_the_field():
    from cluster.process import pin_cpus

    mine = tuple(sorted(os.sched_getaffinity(0)))
    pin_cpus(mine)  # every thread of this process: a no-op change
    assert tuple(sorted(os.sched_getaffinity(0))) == mine
    with pytest.raises(ValueError, match="cpu_affinity: cannot pin to cores \\[4096\\]"):
        pin_cpus((4096,))
    assert tuple(sorted(os.sched_getaffinity(0))) == mine


def test_transfer_config_carries_the_section():
    section = TransferSection(transport="grpc", deadline_s=5, chunk_bytes=1 << 16, grpc_streams=4)
    tc = section.transfer_config("cpu")
    assert tc == TransferConfig(transport="grpc", deadline_s=5, chunk_bytes=1 << 16, grpc_streams=4,
                                torch_backend="gloo", torch_device="cpu")


@pytest.mark.parametrize("backend,device,expected", [("nccl", "cuda", "cuda"), ("gloo", "cuda", "cpu"),
                                                     ("gloo", "cpu", "cpu")])
def test_transfer_config_sends_from_cuda_only_with_nccl(backend, device, expected):
    tc = TransferSection(transport="torch", torch_backend=backend).transfer_config(device)
    assert (tc.transport, tc.torch_backend, tc.torch_device) == ("torch", backend, expected)


@pytest.mark.parametrize("transport,device,pools,expected", [
    ("nixl", "cpu", {("cpu", 1)}, "nixl"), ("nixl", "cpu", {("cpu", 2)}, "nixl"),
    ("nixl", "cpu", {("cpu", 1), ("cpu", 2)}, "nixl"), ("nixl", "cpu", {("cpu", 2), ("cpu", 4)}, "nixl"),
    ("nixl", "cpu", {("cpu", 1), ("cpu", 3)}, "nixl"), ("nixl", "cuda", {("cuda", 2)}, "grpc"),
    ("nixl", "cuda", {("cuda", 1)}, "nixl"), ("nixl", "cpu", {("cpu", 1), ("cuda", 1)}, "nixl"),
    ("nixl", "cpu", {("cpu", 2), ("cuda", 1)}, "grpc"), ("nixl", "cuda", {("cpu", 2), ("cuda", 1)}, "grpc"),
    ("torch", "cpu", {("cpu", 1), ("cpu", 2)}, "torch"), ("grpc", "cpu", {("cpu", 2)}, "grpc")])
def test_nixl_with_tp_pools_of_any_sizes_stays_on_the_cpu(monkeypatch, transport, device, pools, expected):
    """NIXL writes each rank's KV heads into the receiver's ranks holding them (every rank's pool mapped on rank 0
    of a CPU group; heads split otherwise are gathered by the sender, on the host): CPU pools of any TP sizes keep
    it; a cluster with a TP pool and a pool on CUDA moves KV by the engine's copies, on grpc (every pool alike)."""
    from pdcluster import config_sections

    # NOTE: as on a machine with NIXL installed (this one falls back to grpc anyway)
    monkeypatch.setattr(config_sections, "_usable", lambda t: t)
    assert TransferSection(transport=transport).transfer_config(device, frozenset(pools)).transport == expected


# ---- pools that must agree --------------------------------------------------------------------------------------

@pytest.mark.parametrize("key,prefill,decode", [("dtype", "float32", "bfloat16"), ("block_size", 16, 32),
                                                ("kv_cache_dtype", "auto", "int8"), ("max_model_len", 2048, 4096),
                                                ("max_model_len", None, 4096)])
def test_prefill_and_decode_pools_that_disagree_on_the_kv_are_refused_naming_both_values(key, prefill, decode):
    text = lines("prefill:", f"  {key}: {'null' if prefill is None else prefill}", "decode:", f"  {key}: {decode}")
    with pytest.raises(ConfigError) as info:
        ClusterConfig.from_yaml_text(text, "x.yaml")
    err = info.value
    assert (err.path, err.line) == (f"decode.{key}", 4)
    assert f"prefill.{key} is {prefill!r}" in str(err) and f"decode.{key} is {decode!r}" in str(err)


def test_pools_that_agree_load_and_a_colocated_config_ignores_the_idle_pools():
    same = lines("prefill:", "  block_size: 32", "  kv_cache_dtype: int8", "decode:", "  block_size: 32",
                 "  kv_cache_dtype: int8")
    assert ClusterConfig.from_yaml_text(same).decode.block_size == 32
    colo = lines("mode: colocated", "colocated:", "  replicas: 1", "prefill:", "  dtype: bfloat16")
    assert ClusterConfig.from_yaml_text(colo).mode == "colocated"


def test_the_measured_config_carries_its_slo_and_the_router_gets_it():
    cfg = ClusterConfig.from_yaml(os.path.join(REPO, "deploy", "bench-disagg.yaml"))
    assert (cfg.router.slo_ttft_ms, cfg.router.slo_itl_ms) == (5000, 100)
    settings = cfg.router.router_settings(cfg.model, cfg.mode, cfg.transfer.transport)
    assert (settings.slo_ttft_ms, settings.slo_itl_ms, settings.admission_ttft_ms()) == (5000, 100, 20000)
    assert settings.policy(16).slo_itl_s == 0.1
    colocated = ClusterConfig.from_yaml_text(lines("mode: colocated", "colocated:", "  replicas: 1"))
    assert colocated.router.router_settings("m", "colocated", "grpc").policy(16).slo_itl_s is None  # one pool


def test_the_launcher_counts_every_rank_of_a_tp_worker_before_starting_it():
    from pdcluster.launch import Cluster
    from pdcluster.security import SetupError
    from router.errors import Overloaded

    cfg = ClusterConfig.from_yaml_text(lines(
        "model: tiny", "prefill: {tensor_parallel_size: 2, num_cpus: 1.5, replicas: 2}", "decode: {num_cpus: 1}"))
    cluster = Cluster(cfg)
    cluster._check_resources({"CPU": 7.0})  # 2 x (2 ranks x 1.5) + 1
    with pytest.raises(SetupError, match=r"need 7 CPU \(prefill: 2 x 3, decode: 1 x 1\) but the Ray cluster has 6"):
        cluster._check_resources({"CPU": 6.0})
    with pytest.raises(Overloaded, match="needs CPU 3"):
        Cluster._check_room(next(iter(cfg.pools())), cfg.prefill, {"CPU": 2.5})
