"""Generate the Python gRPC code next to the layer that serves it (`make proto`): proto/L/v1/x.proto → L/v1/.

Each proto keeps `package pdcluster.v1` (the wire names); its folder under proto/ names the Python package that
owns the stubs (`kv_transfer/v1/`, `router/v1/`). `--out DIR` writes elsewhere.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def generate(out: pathlib.Path) -> list[pathlib.Path]:
    protos = sorted((ROOT / "proto").rglob("*.proto"))
    args = [f"-I{ROOT / 'proto'}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    # NOTE: protoc runs in a process of its own: grpc_tools' compiler and NIXL's bundled libraries (abseil,
    # protobuf) crash when both are loaded into one process (a test run that used the nixl transport)
    if subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args, *map(str, protos)]).returncode != 0:
        raise SystemExit("protoc failed")
    return sorted(p.relative_to(out) for p in out.rglob("*_pb2*.py*"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    files = generate(parser.parse_args().out)
    print("\n".join(map(str, files)), file=sys.stderr)
