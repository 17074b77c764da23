"""The tables `pdcluster bench path` prints (pdcluster/bench/path.py measures the figures)."""

from __future__ import annotations

from typing import Any

TOP_THREADS = 6  # threads per worker in the table of where the workers' CPU went


def _fronts(r: dict[str, Any]) -> list[str]:
    """The fronts measured in one model's figures."""
    return [k for k in r if k not in ("engine", "cluster")]


def format_table(f: dict[str, Any]) -> str:
    n = f["streams"]
    interval = f.get("stream_interval", 1)
    head = (f"| model | front | TTFT ms (engine) | added | ITL p50 ms (step) | added | tok/s 1 (ratio) | "
            f"tok/s {n} (ratio) | router CPU s / 1k tokens (net of idle) | a bare server's (net) |")
    lines = [f"router.stream_interval: {interval} tokens a streamed chunk", ""] if interval > 1 else []
    lines += [f"the router's event loop: {f['event_loop']}", ""] if "event_loop" in f else []
    lines += [head, "|" + "---|" * 10]
    for model, r in f["models"].items():
        for front in _fronts(r):
            c = r[front]  # NOTE: beside it, the engine alone's side of the front's pairs (bench/path_engine.py)
            lines.append(f"| {model} | {front} | {c['ttft_ms_p50']:.1f} ({c['engine_ttft_ms_p50']:.1f}) | "
                         f"{c['ttft_added_ms']:+.1f} | {c['itl_ms_p50']:.2f} ({c['engine_step_ms_p50']:.2f}) | "
                         f"{c['itl_added_ms']:+.2f} | {c['tok_s_1']:.0f} ({c['ratio_1']:.2f}x) | "
                         f"{c[f'tok_s_{n}']:.0f} ({c[f'ratio_{n}']:.2f}x) | {c['router_cpu_s_per_1k_tokens']:.3f} "
                         f"({c['router_cpu_s_per_1k_tokens_net']:.3f}) | {c['bare_cpu_s_per_1k_tokens']:.3f} |")
    lines += ["", "Where the first token's time goes (p50 ms; the router's timeline of the same requests):", "",
              "| model | front | engine alone | client TTFT | router: first token sent | queue (to prefill start) "
              "| prefill | prefill worker's step | router CPU ms / request (net of idle) | a bare server's (net) |",
              "|" + "---|" * 10]
    for model, r in f["models"].items():
        for front in _fronts(r):
            c = r[front]
            if "router_first_token_ms_p50" in c:
                lines.append(f"| {model} | {front} | {c['engine_ttft_ms_p50']:.1f} | {c['ttft_ms_p50']:.1f} | "
                             f"{c['router_first_token_ms_p50']:.1f} | {c['router_queue_ms_p50']:.1f} | "
                             f"{c['router_prefill_ms_p50']:.1f} | {c.get('prefill_worker_step_ms_mean', 0):.1f} | "
                             f"{c['router_cpu_ms_per_request']:.2f} ({c['router_cpu_ms_per_request_net']:.2f}) | "
                             f"{c.get('bare_cpu_ms_per_request', float('nan')):.2f} |")
    lines += ["", "One stream, ms per token: the decode worker's own engine step (mean over the 1-stream runs) and "
              "the rest (relay, the worker's loop, the client):", "",
              "| model | front | engine alone: step | through the cluster: per token | decode worker's step | rest |",
              "|" + "---|" * 6]
    for model, r in f["models"].items():
        for front in _fronts(r):
            c, per_token = r[front], 1e3 / r[front]["tok_s_1"]
            if "worker_step_ms_mean_1" in c:
                lines.append(f"| {model} | {front} | {c['engine_step_ms_mean_1']:.3f} | {per_token:.3f} | "
                             f"{c['worker_step_ms_mean_1']:.3f} | {per_token - c['worker_step_ms_mean_1']:.3f} |")
    lines += ["", f"The workers' CPU per request of the TTFT case (ms, the {TOP_THREADS} busiest threads of each; "
              "a hand-off each):", "", "| model | front | worker | threads |", "|---|---|---|---|"]
    for model, r in f["models"].items():
        for front in _fronts(r):
            for role, ms in r[front].get("threads_ms_per_request", {}).items():
                busiest = ", ".join(f"{name} {v:.2f}" for name, v in list(ms.items())[:TOP_THREADS])
                lines.append(f"| {model} | {front} | {role} | {busiest} |")
    return "\n".join(lines)
