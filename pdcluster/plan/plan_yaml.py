"""Write a planned deploy YAML: a template from deploy/ with the pools' sizes set, under a header saying how.

The template's comments and every other key are kept; only `replicas` of the planned pools change (and for a
worker of several GPUs: `model`, each pool's `tensor_parallel_size` with `num_gpus: 1` per rank, and a header
saying what a node needs), and the router's SLOs the plan was searched for (`slo_ttft_ms`, `slo_itl_ms`). The
result must load with `ClusterConfig.from_yaml` before it is written.
"""

from __future__ import annotations

import os
import re

from pdcluster.config import ClusterConfig

GPU_TEMPLATE = "deploy/gpu-cluster.yaml"
KEEP = "<keep>"  # set_pool_field's value that keeps the line's value (only its comment changes)
CPU_TEMPLATE = "deploy/local.yaml"


def _section(lines: list[str], name: str) -> tuple[int, int]:
    """Line range [start, end) of top-level section `name:` (end: the next top-level key)."""
    start = next((i for i, line in enumerate(lines) if re.match(rf"^{name}:", line)), None)
    if start is None:
        raise ValueError(f"the template has no top-level section {name!r}")
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or lines[end][0] in " \t#"):
        end += 1
    return start, end


def _note(line: str, comment: str) -> str:
    """` # comment`, padded so that it starts at the templates' comment column."""
    return f"{'':{max(1, 30 - len(line))}}# {comment}"


def set_pool_field(text: str, pool: str, field: str, value: int | float | str, comment: str | None = None) -> str:
    """`text` with `field` of top-level section `pool` set to `value` (added if the section lacks it); `comment`
    replaces the line's comment (None keeps it)."""
    lines = text.splitlines()
    start, end = _section(lines, pool)
    pattern = re.compile(rf"^(\s+){field}:\s*([^#\s]+)(\s*#.*)?$")
    for i in range(start + 1, end):
        m = pattern.match(lines[i])
        if m:
            line = f"{m.group(1)}{field}: {m.group(2) if value is KEEP else value}"
            lines[i] = line + (m.group(3) or "" if comment is None else _note(line, comment))
            break
    else:
        if value is KEEP:
            return text
        line = f"  {field}: {value}"
        lines.insert(start + 1, line + ("" if comment is None else _note(line, comment)))
    return "\n".join(lines) + "\n"


def set_top(text: str, key: str, value: str, comment: str | None = None) -> str:
    """`text` with top-level scalar `key` set to `value` (its comment kept, or replaced by `comment`)."""
    def line(m: re.Match[str]) -> str:
        head = f"{key}: {value}"
        return head + (m.group(1) or "" if comment is None else _note(head, comment))

    return re.sub(rf"^{key}:\s*[^#\n]*?(\s*#.*)?$", line, text, count=1, flags=re.M)


def copy_section(text: str, src: str, dst: str) -> str:
    """`text` with section `src` copied at the end as `dst` (a colocated pool sized like the decode pool)."""
    lines = text.splitlines()
    start, end = _section(lines, src)
    body = [line for line in lines[start + 1:end] if line.strip() and not line.lstrip().startswith("#")]
    head = f"{dst}:                    # the settings of the {src} pool"
    return text.rstrip("\n") + "\n\n" + "\n".join([head, *body]) + "\n"


def tp_header(tp: int, workers: int, gpu_memory_gb: float | None = None) -> list[str]:
    """What the nodes of a plan whose workers are TP groups of `tp` GPUs (of `gpu_memory_gb` each, when the profile
    says) must offer (header lines)."""
    gpus = f"{tp} GPUs" + (f" of {gpu_memory_gb:g} GB" if gpu_memory_gb else "")
    return [f"Each worker is one engine over {tp} GPUs (tensor_parallel_size {tp}; num_cpus, num_gpus and",
            f"torch_threads are per rank). Its {tp} ranks are Ray actors of one placement group (STRICT_PACK: one",
            f"node): a node needs {gpus} linked by NVLink (an H100/H200 SXM node) and {tp} x num_cpus CPUs,",
            f"and holds one worker: {workers} such nodes in all."]


def render(template: str, mode: str, replicas: dict[str, int], header: list[str],
           gpus_per_worker: int | None = None, router: dict[str, float] | None = None,
           model: str | None = None, gpu_memory_gb: float | None = None) -> str:
    """The template with `mode`, each pool's replicas and the `router` settings given set, and `header` as leading
    comment lines. `gpus_per_worker` > 1 (a GPU template): each worker a TP group of that many ranks, one GPU
    each, running `model` (e.g. random:llama-3.1-70b; None keeps the template's)."""
    with open(template, encoding="utf-8") as f:
        text = f.read()
    text = set_top(text, "mode", mode)
    tp = gpus_per_worker if gpus_per_worker is not None and gpus_per_worker > 1 else 1
    if model is not None:
        text = set_top(text, "model", model, "random weights of its shape; or a Hugging Face directory (same "
                                             "path on every node)")
    for pool, n in replicas.items():
        if not re.search(rf"^{pool}:", text, flags=re.M):
            text = copy_section(text, "decode", pool)
        text = set_pool_field(text, pool, "replicas", n)
        if tp > 1:
            # NOTE: per rank, as vLLM and Ray Serve LLM count: the actor reserves tp GPUs of one node
            text = set_pool_field(text, pool, "num_gpus", 1, "per rank: the worker reserves "
                                                             f"{tp} GPUs of one node")
            text = set_pool_field(text, pool, "tensor_parallel_size", tp, f"one engine over {tp} GPUs")
            text = set_pool_field(text, pool, "kv_cache_memory_gb", KEEP, "KV cache per rank, as planned (null: "
                                                                            "by gpu_memory_utilization)")
            text = set_pool_field(text, pool, "num_cpus", KEEP, "Ray CPUs per rank")
            text = set_pool_field(text, pool, "torch_threads", KEEP, "per rank")
    for key, value in (router or {}).items():
        text = set_pool_field(text, "router", key, value)
    if tp > 1:
        header = [*header, "", *tp_header(tp, sum(replicas.values()), gpu_memory_gb)]
    text = "".join(f"# {line}\n" if line else "#\n" for line in header) + "#\n" + text
    ClusterConfig.from_yaml_text(text, "<planned>")  # NOTE: raises ConfigError naming the field if it broke
    return text


def write(path: str, text: str) -> ClusterConfig:
    """Write the YAML and load it back as `pdcluster serve` would."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return ClusterConfig.from_yaml(path)
