"""The compiled attention kernel (engine/csrc/): built once by the install step, loaded by the engine if present.

`python -m engine.kernels build` compiles it with torch's cpp_extension (scripts/install.sh runs it); at run time
`attention_kernel()` imports the built module, or returns None (the engine then uses the pure-torch gather path,
and says so once in the log). The module's name carries a hash of the sources, so a stale build is never loaded.
`PDCLUSTER_ATTENTION=gather` forces the fallback; `=kernel` makes a missing kernel an error instead.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / "paged_attention.cpp"]
BUILD_DIR = Path(os.environ.get("PDCLUSTER_KERNEL_DIR", CSRC / "build"))
ENV = "PDCLUSTER_ATTENTION"
BACKENDS = ("auto", "kernel", "gather")
# NOTE: built on the machine that runs it (the install step), so -march=native is safe there and pays for
# AVX-512 on the dot products; a compiler that rejects it gets a portable retry (see build()).
# NOTE: -fopenmp because at::parallel_for (torch's thread pool) is an inline `omp parallel` in ATen's headers:
# without it the kernel ran on one thread. It links libgomp.so.1, the soname torch has already loaded.
NATIVE_FLAGS = ["-O3", "-march=native", "-fopenmp"]
PORTABLE_FLAGS = ["-O3", "-fopenmp"]

_loaded: ModuleType | None = None
_tried = False


def module_name() -> str:
    """Extension name: a hash of the kernel sources and flags, so edited sources never load an old build."""
    flags = " ".join(NATIVE_FLAGS + PORTABLE_FLAGS).encode()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES) + flags).hexdigest()[:12]
    return f"pdcluster_attention_{digest}"


def build(verbose: bool = False) -> Path:
    """Compile the kernel into BUILD_DIR (no-op when current); returns the shared library's path. Raises on failure."""
    from torch.utils import cpp_extension

    name = module_name()
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    last: Exception | None = None
    for flags in (NATIVE_FLAGS, PORTABLE_FLAGS):
        try:
            cpp_extension.load(name, [str(s) for s in SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                               build_directory=str(BUILD_DIR), verbose=verbose)
            return BUILD_DIR / f"{name}.so"
        except Exception as e:  # noqa: BLE001 (compiler errors come as several types; retry portable, then raise)
            last = e
            log.warning("attention kernel build with %s failed: %s", " ".join(flags), e)
    raise RuntimeError(f"attention kernel build failed: {last}") from last


def _import(path: Path) -> ModuleType:
    import torch  # noqa: F401 (the extension links against libtorch, which must be loaded first)

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def backend_choice() -> str:
    """The requested backend from PDCLUSTER_ATTENTION: auto (default), kernel or gather."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"{ENV} must be one of {BACKENDS}, got {choice!r}")
    return choice


def attention_kernel() -> ModuleType | None:
    """The built kernel module, or None when it is not built (logged once) or PDCLUSTER_ATTENTION=gather."""
    global _loaded, _tried
    choice = backend_choice()
    if choice == "gather":
        return None
    if not _tried:
        _tried = True
        path = BUILD_DIR / f"{module_name()}.so"
        try:
            _loaded = _import(path)
        except (ImportError, OSError) as e:
            log.warning("attention kernel not available (%s: %s); using the pure-torch gather path. Build it with "
                        "`python -m engine.kernels build` (scripts/install.sh does).", path, e)
    if _loaded is None and choice == "kernel":
        raise RuntimeError(f"{ENV}=kernel but the attention kernel is not built (python -m engine.kernels build)")
    return _loaded


def ensure_built() -> ModuleType:
    """Build the kernel if needed and load it (tests and benches); raises when it cannot be built."""
    global _loaded, _tried
    if _loaded is None:
        _loaded, _tried = _import(build()), True
    return _loaded


def main(argv: list[str]) -> int:
    if argv[:1] != ["build"]:
        print("usage: python -m engine.kernels build [-v]", file=sys.stderr)
        return 2
    try:
        path = build(verbose="-v" in argv)
    except RuntimeError as e:
        # NOTE: not fatal for the install: the engine runs on the gather path without the kernel.
        print(f"WARNING: {e}\nthe engine will use the pure-torch attention path", file=sys.stderr)
        return 1
    print(f"attention kernel built: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
