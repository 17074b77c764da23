"""summary.json of scripts/gpu-check.sh: each step's status, seconds and figures, and why a figure is missing.

The script records one line per finished step in OUTDIR/.steps ("name rc seconds") and each step's output in
OUTDIR/<name>.log; after every step it runs `python -m pdcluster.bench.gpu_summary OUTDIR`, so a run cut short
keeps what it had. A step's figures are its JSON file (env.json, correctness.json, bench_engine_device.json,
bench_engine_profile.json; the cluster step's cluster_<part>.json, without their per-request lists) or its JUnit XML
(pytest_<name>.xml: counts, failed tests, and the figures tests recorded as properties); when one is missing the
summary says so, with the step's exit status (timed out or not) and the tail of its log, and for a pytest step that
died before writing its XML, the results its `-v` log had printed. Standard
library only: it runs where nothing else of the project may import.
"""

from __future__ import annotations

import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from typing import Any

FIGURES = {"setup": "env.json", "correctness": "correctness.json", "bench": "bench_engine_device.json",
           "profile": "bench_engine_profile.json"}
# the cluster step's parts (pdcluster/bench/gpu_cluster.py), each its own cluster_<part>.json
CLUSTER_PARTS = ("text", "handoff", "serve", "mps")
BULKY = ("requests", "runs", "traceback", "config")  # per-request and per-run detail stays in the part's own file
PYTEST_PREFIX = "gpu_"  # steps named gpu_* run pytest with --junitxml pytest_<name>.xml
TAIL_LINES = 15
_RESULT = re.compile(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def read_steps(out: str) -> dict[str, dict[str, Any]]:
    """The finished steps, in order, from OUTDIR/.steps."""
    steps: dict[str, dict[str, Any]] = {}
    try:
        with open(os.path.join(out, ".steps")) as f:
            lines = f.read().split("\n")
    except OSError:
        return steps
    for line in lines:
        parts = line.split()
        if len(parts) != 3:
            continue
        name, rc, secs = parts
        steps[name] = {"rc": int(rc), "passed": rc == "0", "timed_out": rc in ("124", "137"), "seconds": int(secs)}
    return steps


def _log(out: str, name: str) -> list[str]:
    try:
        with open(os.path.join(out, f"{name}.log"), errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def missing(out: str, name: str, file: str, step: dict[str, Any] | None) -> dict[str, Any]:
    """Why step `name` left no `file`: not run, timed out, or failed, with the tail of its log."""
    if step is None:
        why = "the step did not run (the script stopped before it, or GPU_CHECK_STEPS left it out)"
    elif step["timed_out"]:
        why = f"the step timed out after {step['seconds']} s (rc {step['rc']}) before writing it"
    else:
        why = f"the step exited with rc {step['rc']} after {step['seconds']} s without writing it"
    return {"missing": file, "why": why, "log_tail": _log(out, name)[-TAIL_LINES:]}


def junit(path: str) -> dict[str, Any]:
    """Counts and failed test ids of a JUnit XML file."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, path
    res: dict[str, Any] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    res["failed"] = [c.get("classname", "") + "::" + c.get("name", "") for c in suite.iter("testcase")
                     if c.find("failure") is not None or c.find("error") is not None]
    # NOTE: figures a test recorded with pytest's record_property (the NIXL GPU test's GB/s)
    res["figures"] = {c.get("name", ""): {p.get("name", ""): p.get("value", "") for p in c.iter("property")}
                      for c in suite.iter("testcase") if c.find("properties") is not None}
    return res


def results_from_log(lines: list[str]) -> dict[str, list[str]]:
    """Test ids by outcome, as pytest -v printed them (what a step killed before its XML still shows)."""
    by: dict[str, list[str]] = {}
    for line in lines:
        m = _RESULT.match(line)
        if m:
            by.setdefault(m.group(2).lower(), []).append(m.group(1))
    return by


def _lean(value: Any) -> Any:
    """`value` without the per-request and per-run lists (nested dicts included)."""
    if isinstance(value, dict):
        return {k: _lean(v) for k, v in value.items() if k not in BULKY}
    return value


def _cluster_part(out: str, part: str, step: dict[str, Any]) -> dict[str, Any]:
    file = f"cluster_{part}.json"
    try:
        with open(os.path.join(out, file)) as f:
            return dict(_lean(json.load(f)))
    except (OSError, ValueError):
        return missing(out, "cluster", file, step)


def summarize(out: str) -> dict[str, Any]:
    """The summary of OUTDIR (see the module docstring)."""
    steps = read_steps(out)
    summary: dict[str, Any] = {"steps": steps, "passed": bool(steps) and all(s["passed"] for s in steps.values())}
    for name, file in FIGURES.items():
        try:
            with open(os.path.join(out, file)) as f:
                summary[name] = json.load(f)
        except (OSError, ValueError):
            summary[name] = missing(out, name, file, steps.get(name))
    if "cluster" in steps:
        summary["cluster"] = {part: _cluster_part(out, part, steps["cluster"]) for part in CLUSTER_PARTS}
    for name in [s for s in steps if s.startswith(PYTEST_PREFIX)]:
        file = f"pytest_{name}.xml"
        try:
            summary[name] = junit(os.path.join(out, file))
        except (OSError, ET.ParseError, AssertionError):
            summary[name] = missing(out, name, file, steps[name]) | {"from_log": results_from_log(_log(out, name))}
    return summary


def main(argv: list[str] | None = None) -> int:
    """`python -m pdcluster.bench.gpu_summary OUTDIR [--print]`: write OUTDIR/summary.json; --print also prints it
    and exits 0 only when every step passed."""
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(main.__doc__, file=sys.stderr)
        return 2
    out = args[0]
    summary = summarize(out)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    if "--print" in args:
        print(json.dumps(summary, indent=1))
        return 0 if summary["passed"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
