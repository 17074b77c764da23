"""Write a planned deploy YAML: a template from deploy/ with the pools' sizes set, under a header saying how.

The template's comments and every other key are kept; only `replicas` (and `num_gpus` for tensor-parallel workers)
of the planned pools change, and the router's SLOs the plan was searched for (`slo_ttft_ms`, `slo_itl_ms`). The
result must load with `ClusterConfig.from_yaml` before it is written.
"""

from __future__ import annotations

import os
import re

from pdcluster.config import ClusterConfig

GPU_TEMPLATE = "deploy/gpu-cluster.yaml"
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


def set_pool_field(text: str, pool: str, field: str, value: int | float | str) -> str:
    """`text` with `field` of top-level section `pool` set to `value` (added if the section lacks it)."""
    lines = text.splitlines()
    start, end = _section(lines, pool)
    pattern = re.compile(rf"^(\s+){field}:\s*[^#\s]+(\s*#.*)?$")
    for i in range(start + 1, end):
        m = pattern.match(lines[i])
        if m:
            lines[i] = f"{m.group(1)}{field}: {value}{m.group(2) or ''}"
            break
    else:
        lines.insert(start + 1, f"  {field}: {value}")
    return "\n".join(lines) + "\n"


def set_top(text: str, key: str, value: str) -> str:
    """`text` with top-level scalar `key` set to `value` (comment kept)."""
    return re.sub(rf"^{key}:\s*[^#\n]*?(\s*#.*)?$", lambda m: f"{key}: {value}{m.group(1) or ''}", text, count=1,
                  flags=re.M)


def copy_section(text: str, src: str, dst: str) -> str:
    """`text` with section `src` copied at the end as `dst` (a colocated pool sized like the decode pool)."""
    lines = text.splitlines()
    start, end = _section(lines, src)
    body = [line for line in lines[start + 1:end] if line.strip() and not line.lstrip().startswith("#")]
    head = f"{dst}:                    # the settings of the {src} pool"
    return text.rstrip("\n") + "\n\n" + "\n".join([head, *body]) + "\n"


def render(template: str, mode: str, replicas: dict[str, int], header: list[str],
           gpus_per_worker: int | None = None, router: dict[str, float] | None = None) -> str:
    """The template with `mode`, each pool's replicas and the `router` settings given set, and `header` as leading
    comment lines."""
    with open(template, encoding="utf-8") as f:
        text = f.read()
    text = set_top(text, "mode", mode)
    for pool, n in replicas.items():
        if not re.search(rf"^{pool}:", text, flags=re.M):
            text = copy_section(text, "decode", pool)
        text = set_pool_field(text, pool, "replicas", n)
        if gpus_per_worker is not None and gpus_per_worker > 1:
            text = set_pool_field(text, pool, "num_gpus", gpus_per_worker)
    for key, value in (router or {}).items():
        text = set_pool_field(text, "router", key, value)
    text = "".join(f"# {line}\n" if line else "#\n" for line in header) + "#\n" + text
    ClusterConfig.from_yaml_text(text, "<planned>")  # NOTE: raises ConfigError naming the field if it broke
    return text


def write(path: str, text: str) -> ClusterConfig:
    """Write the YAML and load it back as `pdcluster serve` would."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return ClusterConfig.from_yaml(path)
