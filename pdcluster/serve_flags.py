"""`pdcluster serve`'s flags: each overrides one field of the YAML (and of the PDCLUSTER_* variables), as vLLM's
`vllm serve` flags of the same names do."""

from __future__ import annotations

import argparse
from typing import Any


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The model argument and the override flags of `serve`."""
    parser.add_argument("model", nargs="?", default=None, metavar="MODEL",
                        help="override model: 'smollm2', 'random:<arch>', a .gguf file or a Hugging Face directory")
    parser.add_argument("--config", default="deploy/local.yaml", help="deploy YAML (see deploy/README.md)")
    parser.add_argument("--check", action="store_true", help="validate the YAML with the environment and these "
                        "flags laid over it, print the pools it would start, and exit (nothing starts; exit code 2 "
                        "and the field and line of each problem if it is refused)")
    parser.add_argument("--host", default=None, help="override router.host, http.host and metrics.host")
    parser.add_argument("--port", type=int, default=None, help="override router.port (0: any free port)")
    parser.add_argument("--http-port", type=int, default=None, help="override http.port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=None, help="override metrics.port (0: any free port)")
    parser.add_argument("--prefill-replicas", type=int, default=None, help="override prefill.replicas")
    parser.add_argument("--decode-replicas", type=int, default=None, help="override decode.replicas")
    parser.add_argument("--served-model-name", default=None, help="override http.served_model_name")
    parser.add_argument("--api-keys-env", default=None, metavar="NAME", help="override security.api_keys_env: the "
                        "environment variable with the keys clients must send (needed to serve a non-loopback --host)")
    parser.add_argument("--keep-workers", action="store_true", default=None, help="set ray.keep_workers: leave the "
                        "workers running on SIGINT/SIGTERM, for the next `serve` to re-attach to (needs a Ray that "
                        "outlives this process and security.cluster_token_env)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH", type=_lora_module,
                        help="set lora.modules (vLLM's flag): LoRA adapters every worker loads, each a name requests "
                        "choose by `model` and a PEFT directory")
    parser.add_argument("--max-loras", type=int, default=None, help="override lora.max_loras (adapters resident per "
                        "worker)")
    parser.add_argument("--max-lora-rank", type=int, default=None, help="override lora.max_lora_rank")


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH (e.g. sql=/adapters/sql-lora)")
    return name, path


def apply_flags(config: Any, args: argparse.Namespace) -> Any:
    """The config with the command line's overrides (flags win over the YAML and PDCLUSTER_* variables)."""
    from pdcluster.config import ClusterConfig
    from pdcluster.yaml_source import ConfigError, ConfigIssue

    data = config.model_dump()
    for attr, path in (("model", "model"), ("port", "router.port"), ("http_port", "http.port"),
                       ("metrics_port", "metrics.port"), ("prefill_replicas", "prefill.replicas"),
                       ("decode_replicas", "decode.replicas"), ("served_model_name", "http.served_model_name"),
                       ("host", "router.host"), ("host", "http.host"), ("host", "metrics.host"),
                       ("api_keys_env", "security.api_keys_env"), ("keep_workers", "ray.keep_workers"),
                       ("max_loras", "lora.max_loras"), ("max_lora_rank", "lora.max_lora_rank")):
        value = getattr(args, attr, None)
        if value is not None:
            *sections, key = path.split(".")
            target = data
            for section in sections:
                target = target[section]
            target[key] = value
    modules = getattr(args, "lora_modules", None)
    if modules is not None:
        data["lora"]["modules"] = dict(modules)
        if len(data["lora"]["modules"]) < len(modules):
            raise ConfigError("command line", [ConfigIssue("lora.modules", None, "--lora-modules names an adapter "
                                                                                "twice")])
    # NOTE: validated again, so a flag is checked as the same field in the YAML would be (--prefill-replicas 0)
    return ClusterConfig.from_data(data, "command line")


