"""The multi-node deploy files, checked offline: the KubeRay manifests and the `ray up` cluster config parse, match
the parts of their schemas we use, and every pool of the pdcluster configs lands on, and fits, its node type.

A node type is "something that advertises resources, `count` times": a KubeRay worker group (its rayStartParams,
`replicas` pods) or a `ray up` node type (its `resources`, `min_workers` nodes). A pool fits when, per node type,
replicas x (CPUs, GPUs, custom resources) per worker of the pools placed there stay within count x what it advertises.
"""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
import yaml

from pdcluster.config import ClusterConfig, PoolConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent
KUBERAY = ROOT / "deploy" / "kuberay-raycluster.yaml"
RAY_UP = ROOT / "deploy" / "ray-cluster-aws.yaml"
GPU_CLUSTER = ROOT / "deploy" / "gpu-cluster.yaml"
POOL_RESOURCES = {"prefill": "prefill_node", "decode": "decode_node"}
SECRET = "pdcluster-secrets"

# The subset of the Kubernetes objects and of the RayCluster CRD (ray.io/v1) that deploy/ uses. Unknown keys are
# allowed (the real schemas have many more); what is listed must have the right shape.
_QUANTITY = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer", "minimum": 0}]}
_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
    "labels": {"$ref": "#/$defs/strings"}, "annotations": {"$ref": "#/$defs/strings"}}}
_DEFS: dict[str, Any] = {
    "strings": {"type": "object", "additionalProperties": {"type": "string"}},
    "container": {"type": "object", "required": ["name", "image"], "properties": {
        "name": {"type": "string"}, "image": {"type": "string", "minLength": 1},
        "command": {"type": "array", "items": {"type": "string"}},
        "args": {"type": "array", "items": {"type": "string"}},
        "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"], "properties": {
            "name": {"type": "string", "maxLength": 15}, "containerPort": {"type": "integer", "minimum": 1}}}},
        "resources": {"type": "object", "additionalProperties": False, "properties": {
            "requests": {"type": "object", "additionalProperties": _QUANTITY},
            "limits": {"type": "object", "additionalProperties": _QUANTITY}}},
        "env": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "value": {"type": "string"}}}},
        "volumeMounts": {"type": "array", "items": {"type": "object", "required": ["name", "mountPath"]}}}},
    "podTemplate": {"type": "object", "required": ["spec"], "properties": {
        "metadata": {"type": "object", "properties": {"labels": {"$ref": "#/$defs/strings"}}},
        "spec": {"type": "object", "required": ["containers"], "properties": {
            "containers": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/container"}},
            "nodeSelector": {"$ref": "#/$defs/strings"},
            "tolerations": {"type": "array", "items": {"type": "object"}},
            "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}}}}}},
    # NOTE: KubeRay's CRD types rayStartParams as map[string]string; `num-gpus: 8` (a number) is refused.
    "rayStartParams": {"$ref": "#/$defs/strings"},
}
RAYCLUSTER_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": _DEFS, "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayCluster"}, "metadata": _META,
        "spec": {"type": "object", "required": ["headGroupSpec"], "properties": {
            "rayVersion": {"type": "string"},
            "headGroupSpec": {"type": "object", "required": ["template"], "properties": {
                "rayStartParams": {"$ref": "#/$defs/rayStartParams"}, "template": {"$ref": "#/$defs/podTemplate"}}},
            "workerGroupSpecs": {"type": "array", "items": {
                "type": "object", "required": ["groupName", "replicas", "minReplicas", "maxReplicas", "template"],
                "properties": {
                    "groupName": {"type": "string", "minLength": 1},
                    "replicas": {"type": "integer", "minimum": 0},
                    "minReplicas": {"type": "integer", "minimum": 0},
                    "maxReplicas": {"type": "integer", "minimum": 0},
                    "rayStartParams": {"$ref": "#/$defs/rayStartParams"},
                    "template": {"$ref": "#/$defs/podTemplate"}}}}}}}}
CONFIGMAP_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": _DEFS, "type": "object",
    "required": ["apiVersion", "kind", "metadata", "data"], "properties": {
        "apiVersion": {"const": "v1"}, "kind": {"const": "ConfigMap"}, "metadata": _META,
        "data": {"$ref": "#/$defs/strings"}}}
SERVICE_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": _DEFS, "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"], "properties": {
        "apiVersion": {"const": "v1"}, "kind": {"const": "Service"}, "metadata": _META,
        "spec": {"type": "object", "required": ["selector", "ports"], "properties": {
            "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
            "selector": {"$ref": "#/$defs/strings"},
            "ports": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["name", "port"], "properties": {
                    "name": {"type": "string"}, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "targetPort": {"type": ["integer", "string"]},
                    "protocol": {"enum": ["TCP", "UDP", "SCTP"]}}}}}}}}
SCHEMAS = {("v1", "ConfigMap"): CONFIGMAP_SCHEMA, ("ray.io/v1", "RayCluster"): RAYCLUSTER_SCHEMA,
           ("v1", "Service"): SERVICE_SCHEMA}
SCHEMA_OF_KIND = {kind: schema for (_, kind), schema in SCHEMAS.items()}


@dataclass(frozen=True)
class NodeType:
    """What one node (pod) of a type advertises to Ray, and how many such nodes there are."""

    count: int
    resources: dict[str, float]


def _kuberay_docs() -> dict[str, dict[str, Any]]:
    """The documents of the KubeRay file, by kind (each kind once)."""
    docs = [d for d in yaml.safe_load_all(KUBERAY.read_text(encoding="utf-8")) if d is not None]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), f"one document per kind expected, got {[d['kind'] for d in docs]}"
    return by_kind


def _embedded_config() -> ClusterConfig:
    text = _kuberay_docs()["ConfigMap"]["data"]["cluster.yaml"]
    return ClusterConfig.from_yaml_text(text, f"{KUBERAY.name}:ConfigMap/pdcluster-config:cluster.yaml")


def _groups() -> list[dict[str, Any]]:
    """The head group (named 'head') and the worker groups of the RayCluster."""
    spec = _kuberay_docs()["RayCluster"]["spec"]
    return [{"groupName": "head", **spec["headGroupSpec"]}, *spec["workerGroupSpecs"]]


def _container(group: dict[str, Any]) -> dict[str, Any]:
    """The Ray container of a group's pod (KubeRay runs Ray in the first container)."""
    return group["template"]["spec"]["containers"][0]


def _custom_resources(params: dict[str, str]) -> dict[str, float]:
    """The `resources` rayStartParam, written as KubeRay wants it: a JSON object inside a quoted string."""
    if "resources" not in params:
        return {}
    text = params["resources"]
    # '"{\"prefill_node\": 8}"' is a JSON string literal whose value is the object's JSON text.
    inner = json.loads(text)
    assert isinstance(inner, str), f"resources {text!r}: KubeRay wants the JSON object quoted: '\"{{...}}\"'"
    value = json.loads(inner)
    assert isinstance(value, dict) and all(isinstance(v, int | float) for v in value.values()), text
    return {k: float(v) for k, v in value.items()}


def _kuberay_node_types() -> dict[str, NodeType]:
    out = {}
    for g in _groups():
        params = g.get("rayStartParams", {})
        resources = {"CPU": float(params.get("num-cpus", "0")), "GPU": float(params.get("num-gpus", "0")),
                     **_custom_resources(params)}
        out[g["groupName"]] = NodeType(1 if g["groupName"] == "head" else g["replicas"], resources)
    return out


def _ray_up() -> dict[str, Any]:
    data = yaml.safe_load(RAY_UP.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


def _ray_up_node_types() -> dict[str, NodeType]:
    # NOTE: min_workers, not max_workers: the pools are placed once at start, on the nodes that surely exist.
    return {name: NodeType(t["min_workers"], {k: float(v) for k, v in t["resources"].items()})
            for name, t in _ray_up()["available_node_types"].items()}


def _placement(config: ClusterConfig, node_types: dict[str, NodeType]) -> dict[str, str]:
    """Pool -> the one node type that advertises every custom resource the pool asks for."""
    out = {}
    for role, pool in config.pools().items():
        assert pool.resources, f"pool {role}: no custom resource, so nothing pins it to a node type"
        hosts = [n for n, t in node_types.items() if set(pool.resources) <= set(t.resources)]
        assert len(hosts) == 1, f"pool {role} asks for {sorted(pool.resources)}: advertised by {hosts}, want one"
        out[role] = hosts[0]
    return out


def _need(pool: PoolConfig) -> dict[str, float]:
    # NOTE: what the launcher asks Ray for: every rank's CPUs and GPUs of a TP pool
    return {k: v * pool.replicas for k, v in pool.ray_resources().items()}


def _assert_pools_fit(config: ClusterConfig, node_types: dict[str, NodeType]) -> None:
    placement = _placement(config, node_types)
    for name, node in node_types.items():
        pools = {r: p for r, p in config.pools().items() if placement[r] == name}
        for key in sorted({k for p in pools.values() for k in _need(p)}):
            need = sum(_need(p).get(key, 0.0) for p in pools.values())
            have = node.count * node.resources.get(key, 0.0)
            assert need <= have + 1e-9, (f"node type {name}: pools {sorted(map(str, pools))} need {need:g} {key}, "
                                         f"{node.count} nodes x {node.resources.get(key, 0.0):g} give {have:g}")


# --- KubeRay -------------------------------------------------------------------------------------------------


def test_schemas_are_valid_draft_2020_12() -> None:
    for schema in SCHEMAS.values():
        jsonschema.Draft202012Validator.check_schema(schema)


def test_kuberay_documents_match_schema() -> None:
    docs = [d for d in yaml.safe_load_all(KUBERAY.read_text(encoding="utf-8")) if d is not None]
    assert sorted((d["apiVersion"], d["kind"]) for d in docs) == sorted(SCHEMAS)
    for doc in docs:
        validator = jsonschema.Draft202012Validator(SCHEMAS[(doc["apiVersion"], doc["kind"])])
        errors = [f"{doc['kind']}.{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator.iter_errors(doc)]
        assert not errors, "\n".join(errors)


@pytest.mark.parametrize(("kind", "path", "value", "error"), [
    ("RayCluster", ("spec", "workerGroupSpecs", 0, "rayStartParams", "num-gpus"), 8, "is not of type 'string'"),
    ("RayCluster", ("spec", "headGroupSpec", "template", "spec", "containers", 0, "image"), "", "should be non-empty"),
    ("RayCluster", ("spec", "workerGroupSpecs", 1, "replicas"), "4", "is not of type 'integer'"),
    ("Service", ("spec", "ports", 0, "port"), "50051", "is not of type 'integer'"),
    ("ConfigMap", ("metadata", "name"), "PDCluster_Config", "does not match"),
])
def test_schema_refuses_a_broken_document(kind: str, path: tuple[str | int, ...], value: object, error: str) -> None:
    doc = _kuberay_docs()[kind]
    node: Any = doc
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    messages = [e.message for e in jsonschema.Draft202012Validator(SCHEMA_OF_KIND[kind]).iter_errors(doc)]
    assert any(error in m for m in messages), messages


@pytest.mark.parametrize("group", [g["groupName"] for g in _groups()])
def test_ray_start_params_are_strings(group: str) -> None:
    params = next(g for g in _groups() if g["groupName"] == group).get("rayStartParams", {})
    wrong = {k: v for k, v in params.items() if not isinstance(v, str)}
    assert not wrong, f"group {group}: rayStartParams must be strings (KubeRay's CRD), got {wrong}"


def test_embedded_config_is_the_multi_node_one() -> None:
    cfg = _embedded_config()
    assert cfg.ray.address == "auto"
    assert cfg.redis.url is not None and cfg.redis.url.startswith(("redis://", "rediss://"))
    assert cfg.redis.password_env == "REDIS_PASSWORD"
    assert (cfg.router.host, cfg.http.host, cfg.metrics.host) == ("0.0.0.0",) * 3
    assert (cfg.transfer.transport, cfg.transfer.torch_backend, cfg.transfer.host) == ("torch", "nccl", "auto")
    for role, replicas in (("prefill", 16), ("decode", 32)):
        pool = cfg.pools()[role]
        assert (pool.replicas, pool.num_gpus, pool.device, pool.dtype) == (replicas, 1, "cuda", "bfloat16")
        assert pool.resources == {POOL_RESOURCES[role]: 1}
    assert (cfg.security.api_keys_env, cfg.security.cluster_token_env) == ("PDCLUSTER_API_KEYS",
                                                                           "PDCLUSTER_CLUSTER_TOKEN")


def test_head_runs_the_router_with_the_mounted_config() -> None:
    head = next(g for g in _groups() if g["groupName"] == "head")
    container = _container(head)
    script = " ".join(container.get("command", []) + container.get("args", []))
    match = re.search(r"pdcluster serve --config (\S+)", script)
    assert match, f"the head container does not run `pdcluster serve --config ...`: {script!r}"
    config_path = pathlib.PurePosixPath(match.group(1))
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in head["template"]["spec"]["volumes"]}
    by_config_map = [n for n, v in volumes.items() if v.get("configMap", {}).get("name") == "pdcluster-config"]
    assert len(by_config_map) == 1 and mounts.get(by_config_map[0]) == str(config_path.parent)
    assert config_path.name in _kuberay_docs()["ConfigMap"]["data"]
    # NOTE: the annotation makes KubeRay keep this command; without it KubeRay would prepend ours to `ray start`.
    assert _kuberay_docs()["RayCluster"]["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for g in _groups():
        args = " ".join(_container(g)["args"])
        # NOTE: eval: the generated line quotes the --resources JSON; a bare $VAR would split it at its space.
        assert 'eval "$KUBERAY_GEN_RAY_START_CMD"' in args, f"group {g['groupName']} does not start Ray"
        bash = shutil.which("bash")
        if bash is not None:
            check = subprocess.run([bash, "-n", "-c", args], capture_output=True, text=True, timeout=10)
            assert check.returncode == 0, f"group {g['groupName']}: {check.stderr}"


def _secret_env(container: dict[str, Any]) -> set[str]:
    """Environment variables the container takes from the Secret."""
    return {e["name"] for e in container.get("env", [])
            if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == SECRET}


def test_secrets_come_from_the_secret() -> None:
    cfg = _embedded_config()
    redis, api_keys, token = cfg.redis.password_env, cfg.security.api_keys_env, cfg.security.cluster_token_env
    assert redis and api_keys and token
    for g in _groups():
        env = _secret_env(_container(g))
        # the router needs all three; a worker connects to Redis and presents the cluster token
        need = {redis, api_keys, token} if g["groupName"] == "head" else {redis, token}
        assert need <= env, f"group {g['groupName']}: {sorted(need - env)} not taken from Secret {SECRET}"


def test_each_pool_resource_is_advertised_by_exactly_one_worker_group() -> None:
    node_types = _kuberay_node_types()
    assert _placement(_embedded_config(), node_types) == {"prefill": "prefill", "decode": "decode"}
    assert not set(node_types["head"].resources) & set(POOL_RESOURCES.values())


def test_pools_fit_their_worker_groups() -> None:
    _assert_pools_fit(_embedded_config(), _kuberay_node_types())


@pytest.mark.parametrize("group", [g["groupName"] for g in _groups()])
def test_gpu_limit_equals_num_gpus(group: str) -> None:
    g = next(g for g in _groups() if g["groupName"] == group)
    limits = _container(g).get("resources", {}).get("limits", {})
    params = g.get("rayStartParams", {})
    assert int(limits.get("nvidia.com/gpu", 0)) == int(params.get("num-gpus", "0"))
    if "num-cpus" in params and params["num-cpus"] != "0":
        assert str(limits.get("cpu")) == params["num-cpus"], f"group {group}: num-cpus != the cpu limit"
    if group != "head":
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert g["template"]["spec"].get("nodeSelector"), f"group {group} is not pinned to a node type"


def test_gpu_groups_land_on_different_node_types() -> None:
    selectors = [json.dumps(g["template"]["spec"]["nodeSelector"], sort_keys=True)
                 for g in _groups() if g["groupName"] != "head"]
    assert len(set(selectors)) == len(selectors), selectors


def test_service_selects_the_head_and_exposes_the_router_ports() -> None:
    docs = _kuberay_docs()
    svc, cfg = docs["Service"], _embedded_config()
    assert svc["spec"]["selector"] == {"ray.io/cluster": docs["RayCluster"]["metadata"]["name"],
                                       "ray.io/node-type": "head"}
    head_ports = {p.get("name"): p["containerPort"] for p in _container(_groups()[0])["ports"]}
    exposed = {}
    for p in svc["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        exposed[p["port"]] = head_ports[target] if isinstance(target, str) else target
    for port in (cfg.router.port, cfg.http.port, cfg.metrics.port):
        assert exposed.get(port) == port, f"the Service does not route port {port} to the head's {port}: {exposed}"
        assert port in head_ports.values()


# --- ray up ---------------------------------------------------------------------------------------------------


def test_ray_up_config_shape() -> None:
    data = _ray_up()
    required = {"cluster_name", "max_workers", "provider", "auth", "available_node_types", "head_node_type",
                "setup_commands", "head_start_ray_commands", "worker_start_ray_commands"}
    assert required <= set(data), f"missing: {sorted(required - set(data))}"
    assert data["provider"]["type"] == "aws" and {"region", "availability_zone"} <= set(data["provider"])
    types = data["available_node_types"]
    assert data["head_node_type"] in types
    for name, t in types.items():
        assert {"resources", "node_config", "min_workers", "max_workers"} <= set(t), name
        assert 0 <= t["min_workers"] <= t["max_workers"] <= data["max_workers"], name
    assert sum(t["min_workers"] for n, t in types.items() if n != data["head_node_type"]) <= data["max_workers"]
    assert types[data["head_node_type"]]["resources"].get("GPU", 0) == 0, "the head is a CPU node"


def test_ray_up_installs_pdcluster_and_starts_ray() -> None:
    data = _ray_up()
    installs = [c for c in data["setup_commands"] if re.search(r"pip install\b", c)]
    assert any("pdcluster" in arg for c in installs for arg in shlex.split(c)), data["setup_commands"]
    assert data["head_start_ray_commands"][0] == data["worker_start_ray_commands"][0] == "ray stop"
    assert any("ray start --head" in c for c in data["head_start_ray_commands"])
    assert any(re.search(r"ray start --address=\$RAY_HEAD_IP:\d+", c) for c in data["worker_start_ray_commands"])


def test_gpu_cluster_pools_ask_for_the_node_type_resources() -> None:
    cfg = ClusterConfig.from_yaml(GPU_CLUSTER)
    assert {r: set(p.resources) for r, p in cfg.pools().items()} == {r: {k} for r, k in POOL_RESOURCES.items()}
    placement = _placement(cfg, _ray_up_node_types())
    assert placement == {"prefill": "prefill_gpu", "decode": "decode_gpu"}


@pytest.mark.parametrize(("config", "cluster"), [
    ("deploy/gpu-cluster.yaml", "ray up"),
    ("kuberay ConfigMap", "ray up"),
    ("kuberay ConfigMap", "kuberay RayCluster"),
])
def test_pools_fit_node_types(config: str, cluster: str) -> None:
    cfg = ClusterConfig.from_yaml(GPU_CLUSTER) if config.startswith("deploy/") else _embedded_config()
    _assert_pools_fit(cfg, _ray_up_node_types() if cluster == "ray up" else _kuberay_node_types())


def test_a_pool_too_big_for_its_node_type_is_caught() -> None:
    cfg = _embedded_config().model_copy(deep=True)
    cfg.decode.replicas = 33  # 4 nodes x 8 GPUs hold 32
    with pytest.raises(AssertionError, match="node type decode: pools \\['decode'\\] need 33 GPU"):
        _assert_pools_fit(cfg, _kuberay_node_types())


# --- kubectl --------------------------------------------------------------------------------------------------


def _kubectl_with_raycluster_crd() -> str | None:
    """kubectl, when it is on PATH and reaches a cluster that knows RayCluster (a client dry-run needs both)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    try:
        out = subprocess.run([kubectl, "api-resources", "--api-group=ray.io", "-o", "name", "--request-timeout=5s"],
                             capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return kubectl if out.returncode == 0 and "rayclusters" in out.stdout else None


def test_kubectl_client_dry_run() -> None:
    kubectl = _kubectl_with_raycluster_crd()
    if kubectl is None:
        pytest.skip("no kubectl reaching a cluster with the KubeRay CRDs (a client dry-run still asks the API server)")
    out = subprocess.run([kubectl, "apply", "--dry-run=client", "--validate=false", "-f", str(KUBERAY)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


# --- one GPU node (issue 38) ------------------------------------------------------------------------------------

GPU_ONE_NODE = ROOT / "deploy" / "gpu-one-node.yaml"


def _two_gpu_overrides() -> dict[str, str]:
    """The PDCLUSTER_* assignments the header of gpu-one-node.yaml tells a node with two GPUs to set."""
    header = "".join(line for line in GPU_ONE_NODE.read_text().splitlines(keepends=True) if line.startswith("#"))
    found = dict(re.findall(r"(PDCLUSTER_[A-Z_]+)=(\S+)", header))
    assert len(found) == 4, header
    return found


def test_gpu_one_node_shares_one_gpu_as_shipped() -> None:
    cfg = ClusterConfig.from_yaml(GPU_ONE_NODE)
    assert (cfg.model, cfg.mode, cfg.ray.address, cfg.redis.url) == ("random:llama-3.1-8b", "disaggregated", "local",
                                                                       None)
    assert cfg.transfer.transport == "nixl"
    p, d = cfg.prefill, cfg.decode
    assert (p.device, d.device, p.resolved_dtype, d.resolved_dtype) == ("cuda", "cuda", "bfloat16", "bfloat16")
    assert p.num_gpus + d.num_gpus <= 1  # Ray puts both on one GPU
    assert p.gpu_memory_utilization is not None and d.gpu_memory_utilization is not None
    assert p.gpu_memory_utilization + d.gpu_memory_utilization <= 0.9  # room for the two CUDA contexts


def test_gpu_one_node_takes_a_gpu_per_worker_by_its_documented_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in _two_gpu_overrides().items():
        monkeypatch.setenv(key, value)
    cfg = ClusterConfig.from_yaml(GPU_ONE_NODE)
    assert (cfg.prefill.num_gpus, cfg.decode.num_gpus) == (1, 1)
    assert cfg.prefill.gpu_memory_utilization == cfg.decode.gpu_memory_utilization == 0.9
    # NOTE: with a GPU each, NCCL may pair them
    monkeypatch.setenv("PDCLUSTER_TRANSFER__TRANSPORT", "torch")
    monkeypatch.setenv("PDCLUSTER_TRANSFER__TORCH_BACKEND", "nccl")
    assert ClusterConfig.from_yaml(GPU_ONE_NODE).transfer.torch_backend == "nccl"


def test_gpu_one_node_refuses_nccl_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcluster.config import ConfigError

    monkeypatch.setenv("PDCLUSTER_TRANSFER__TRANSPORT", "torch")
    monkeypatch.setenv("PDCLUSTER_TRANSFER__TORCH_BACKEND", "nccl")
    with pytest.raises(ConfigError, match=r"transfer\.torch_backend.*cannot pair two ranks on one GPU"):
        ClusterConfig.from_yaml(GPU_ONE_NODE)


def _gpu_configs() -> list[str]:
    """The pdcluster configs of deploy/ with a GPU pool (files, and the KubeRay ConfigMap's)."""
    names = [p.name for p in (ROOT / "deploy").glob("*.yaml") if "device: cuda" in p.read_text()]
    return sorted(n for n in names if n != KUBERAY.name) + ["kuberay ConfigMap"]


@pytest.mark.parametrize("path", _gpu_configs())
def test_gpu_yamls_move_kv_by_a_transport_that_runs_where_their_pools_are(path: str) -> None:
    cfg = _embedded_config() if path == "kuberay ConfigMap" else ClusterConfig.from_yaml(ROOT / "deploy" / path)
    if cfg.mode != "disaggregated":
        return
    t = cfg.transfer
    assert t.transport in ("nixl", "torch"), f"{path}: {t.transport} stages GPU KV through the host"
    if t.transport == "torch":
        assert t.torch_backend == "nccl", f"{path}: gloo stages GPU KV through the host"
        assert min(cfg.prefill.num_gpus, cfg.decode.num_gpus) >= 1, f"{path}: NCCL needs a GPU per worker"


PLANNED_70B = ROOT / "deploy" / "planned-h100-70b.yaml"


def test_the_70b_plan_is_tp_8_workers_of_a_70b_model_on_whole_nodes() -> None:
    cfg = ClusterConfig.from_yaml(PLANNED_70B)
    assert cfg.model == "random:llama-3.1-70b"
    for pool in (cfg.prefill, cfg.decode):
        assert (pool.tensor_parallel_size, pool.num_gpus, pool.device, pool.dtype) == (8, 1, "cuda", "bfloat16")
        assert pool.ray_resources()["GPU"] == 8  # NOTE: one worker takes a whole 8-GPU node
        assert pool.kv_cache_memory_gb is not None
    header = PLANNED_70B.read_text().split("\nmodel:")[0]
    assert "8 GPUs of 80 GB" in header and "NVLink" in header
    assert f"{cfg.prefill.replicas + cfg.decode.replicas} such nodes" in header


def test_serve_check_accepts_the_70b_plan_and_names_its_tp_pools() -> None:
    import os
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pdcluster", "serve", "--check", "--config", str(PLANNED_70B)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "valid (disaggregated, model random:llama-3.1-70b)" in proc.stdout
    assert "tensor_parallel_size 8; each reserves 32 CPU, 8 GPU, prefill_node 1" in proc.stdout
