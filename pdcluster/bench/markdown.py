"""Markdown tables of a serving benchmark's figures, saved next to its JSON (BENCHMARKS.md quotes them)."""

from __future__ import annotations

from typing import Any


def _ms(d: dict[str, float], key: str) -> str:
    return f"{d[key]:,.0f}"


def runs_table(runs: list[dict[str, Any]]) -> str:
    """One row per run: latency percentiles, throughput, hit rate, SLO attainment."""
    head = ("| run | rate (req/s) | ok / failed | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | "
            "TPOT p50 (ms) | E2E p50 / p99 (ms) | req/s | output tok/s | prefix hit | KV transfer p50 (ms) | SLO met |")
    lines = [head, "|" + " --- |" * 12]
    for r in runs:
        s = r["summary"]
        t, i, e = s["ttft_ms"], s["itl_ms"], s["e2e_ms"]
        lines.append(
            f"| {r['label']} | {r['workload']['rate']:g} | {s['completed']} / {s['failed']} | "
            f"{_ms(t, 'p50')} / {_ms(t, 'p90')} / {_ms(t, 'p99')} | {_ms(i, 'p50')} / {_ms(i, 'p90')} / "
            f"{_ms(i, 'p99')} | {_ms(s['tpot_ms'], 'p50')} | {_ms(e, 'p50')} / {_ms(e, 'p99')} | "
            f"{s['req_per_s']:.2f} | {s['output_tok_per_s']:.1f} | {s['prefix_hit_rate']:.2f} | "
            f"{s['transfer_ms']['p50']:.1f} | {100 * s['slo_attainment']:.0f}% |")
    return "\n".join(lines)


def ratios_table(figures: dict[str, Any]) -> str:
    """The comparisons of `bench compare` as ratio rows against their targets."""
    lines = ["| comparison | workload | rate (req/s) | figure | A | B | A / B | target |", "|" + " --- |" * 8]
    for r in figures.get("disaggregated_vs_colocated", []):
        lines.append(f"| disaggregated (A) vs colocated (B) | {r['workload']} | {r['rate']:g} | ITL p99 (ms) | "
                     f"{r['itl_p99_ms'][0]:,.0f} | {r['itl_p99_ms'][1]:,.0f} | {r['itl_p99_ratio']} | <= 0.5 |")
        lines.append(f"| | | | TTFT p50 (ms) | {r['ttft_p50_ms'][0]:,.0f} | {r['ttft_p50_ms'][1]:,.0f} | "
                     f"{r['ttft_p50_ratio']} | <= 1 |")
    for r in figures.get("prefix_aware_vs_round_robin", []):
        lines.append(f"| prefix-aware (A) vs round-robin (B) | {r['workload']} | {r['rate']:g} | TTFT p50 (ms) | "
                     f"{r['ttft_p50_ms'][0]:,.0f} | {r['ttft_p50_ms'][1]:,.0f} | {r['ttft_p50_ratio']} | <= 0.3 |")
    return "\n".join(lines)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def vllm_table(f: dict[str, Any]) -> str:
    """The comparison as BENCHMARKS.md shows it: one row per workload and server, then the ratios."""
    rows_ = f.get("pdcluster_vs_vllm", [])
    if not rows_:
        return ""
    lines = ["| workload | rate (req/s) | server | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | SLO met | failed |",
             "|" + " --- |" * 8]
    for r in rows_:
        for i, who in enumerate(r["servers"]):
            lines.append(f"| {r['workload']} | {r['rate']:g} | {who} | {r['ttft_p50_ms'][i]:,.0f} | "
                         f"{r['itl_p50_ms'][i]:,.0f} | {r['itl_p99_ms'][i]:,.0f} | "
                         f"{100 * r['slo_attainment'][i]:.0f}% | {r['failed'][i]} |")
    lines += ["", "| workload | SLO attainment >= vLLM | ITL p99 / vLLM (goal <= 0.5) "
                  "| TTFT p50 / vLLM (goal <= 1.5) |",
              "|" + " --- |" * 4]
    for r in rows_:
        g = r["goals_met"]
        lines.append(f"| {r['workload']} | {_met(g['slo_attainment_ge_vllm'])} | {r['itl_p99_ratio']} "
                     f"({_met(g['itl_p99_le_half_vllm'])}) | {r['ttft_p50_ratio']} "
                     f"({_met(g['ttft_p50_le_1_5x_vllm'])}) |")
    return "\n".join(lines)


def goodput_lines(figures: dict[str, Any]) -> str:
    slo = figures["slo"]
    out = []
    for label, g in figures.get("goodput", {}).items():
        got = f"{g['goodput_req_per_s']:g} req/s" if g["goodput_req_per_s"] is not None else "below every rate tried"
        itl = "p90 gap" if slo.get("itl_stat") == "p90" else "TPOT"
        out.append(f"- goodput of {label}: {got} (TTFT <= {slo['ttft_ms']:g} ms and {itl} <= {slo['itl_ms']:g} ms "
                   f"for >= 90% of requests)")
    return "\n".join(out)


def render(figures: dict[str, Any]) -> str:
    """The whole markdown block of one bench output."""
    parts = [runs_table(figures["runs"])]
    if figures.get("disaggregated_vs_colocated") or figures.get("prefix_aware_vs_round_robin"):
        parts.append(ratios_table(figures))
    if figures.get("pdcluster_vs_vllm"):
        parts.append(vllm_table(figures))
    parts.append(goodput_lines(figures))
    return "\n\n".join(p for p in parts if p) + "\n"
