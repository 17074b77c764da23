"""PNG plots next to a serving benchmark's JSON: latency CDFs per run, SLO attainment vs request rate."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pdcluster.bench.stats import GOODPUT_ATTAINMENT


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: files only, no display (CI, servers)
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    xs = sorted(values)
    if xs:
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=label)


def latency_cdfs(runs: Sequence[dict[str, Any]], path: str, title: str) -> str:
    """TTFT, ITL and end-to-end latency CDFs, one line per run; returns the file written."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for run in runs:
        ok = [r for r in run["requests"] if r["error"] is None]
        label = f"{run['label']} @ {run['workload']['rate']:g} req/s"
        _cdf(axes[0], [r["ttft_ms"] for r in ok], label)
        _cdf(axes[1], [g for r in ok for g in r["itl_ms"]], label)
        _cdf(axes[2], [r["e2e_ms"] for r in ok], label)
    from matplotlib.ticker import FuncFormatter, NullFormatter

    for ax, name in zip(axes, ("TTFT (ms)", "inter-token latency (ms)", "end-to-end latency (ms)")):
        ax.set_xscale("log")
        # NOTE: plain numbers at the decades only; labelled minor ticks of a log axis run into each other
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests" if name.startswith(("TTFT", "end")) else "fraction of gaps")
        ax.grid(True, which="both", alpha=0.3)
        ax.axhline(0.99, color="grey", lw=0.6, ls=":")
    axes[0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    return _save(fig, plt, path)


def attainment_vs_rate(runs: Sequence[dict[str, Any]], path: str, title: str) -> str:
    """SLO attainment against request rate, one line per label, with the 90% goodput line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    by_label: dict[str, list[tuple[float, float]]] = {}
    for run in runs:
        by_label.setdefault(run["label"], []).append((run["workload"]["rate"], run["summary"]["slo_attainment"]))
    for label, pts in by_label.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=label)
    return _save_attainment(fig, ax, plt, path, title, "request rate (req/s)", "goodput threshold (90%)")


def attainment_per_minute(runs: Sequence[dict[str, Any]], path: str, title: str, mark_s: float | None = None) -> str:
    """SLO attainment of the requests sent in each minute, one line per run (e.g. autoscaler on vs off);
    `mark_s`: a vertical line where the traffic shifts."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for run in runs:
        pts = run["summary"].get("slo_attainment_per_minute", [])
        overall = 100 * run["summary"]["slo_attainment"]
        ax.plot([p["minute"] + 0.5 for p in pts], [100 * p["slo_attainment"] for p in pts], marker="o",
                label=f"{run['label']} @ {run['workload']['rate']:g} req/s ({overall:.0f}% overall)")
    if mark_s is not None:
        ax.axvline(mark_s / 60, color="grey", ls=":", lw=1, label="traffic shifts")
    return _save_attainment(fig, ax, plt, path, title, "minute of the run (requests by when they were sent)", "90%")


def _save_attainment(fig: Any, ax: Any, plt: Any, path: str, title: str, xlabel: str, goal_label: str) -> str:
    """The common frame of an SLO-attainment plot (the 90% goodput line, axes, legend), saved to `path`."""
    ax.axhline(100 * GOODPUT_ATTAINMENT, color="grey", ls="--", lw=0.8, label=goal_label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requests meeting both SLOs (%)")
    ax.set_ylim(0, 102)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
