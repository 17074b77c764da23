"""The compiled kernels (engine/csrc/): paged attention and the float32 linear layer, one extension module built
once by the install step and loaded by the engine if present.

`python -m engine.kernels build` compiles it with torch's cpp_extension (scripts/install.sh runs it); at run time
`attention_kernel()` / `linear_kernel()` import the built module, or return None (the engine then uses the pure-torch
gather attention and oneDNN's linear, and says so once in the log). The module's name carries a hash of the sources,
so a stale build is never loaded. `PDCLUSTER_ATTENTION=gather` / `PDCLUSTER_LINEAR=onednn` force a fallback;
`=kernel` makes a missing kernel an error instead. `PDCLUSTER_ATTENTION=triton` (engine/attention/triton_backend.py)
does not use this module; `engine.attention.select_backend` resolves the attention choice for a device.
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
SOURCES = [CSRC / "module.cpp", CSRC / "paged_attention.cpp", CSRC / "linear.cpp"]
HEADERS = [CSRC / "kernels.h"]
BUILD_DIR = Path(os.environ.get("PDCLUSTER_KERNEL_DIR", CSRC / "build"))
ENV = "PDCLUSTER_ATTENTION"
BACKENDS = ("auto", "kernel", "gather", "triton")
LINEAR_ENV = "PDCLUSTER_LINEAR"
LINEAR_BACKENDS = ("auto", "kernel", "onednn")
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
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + flags).hexdigest()[:12]
    return f"pdcluster_kernels_{digest}"


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
            log.warning("kernel build with %s failed: %s", " ".join(flags), e)
    raise RuntimeError(f"kernel build failed: {last}") from last


def _import(path: Path) -> ModuleType:
    import torch  # noqa: F401 (the extension links against libtorch, which must be loaded first)

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _choice(env: str, backends: tuple[str, ...]) -> str:
    choice = os.environ.get(env, "auto").strip().lower() or "auto"
    if choice not in backends:
        raise ValueError(f"{env} must be one of {backends}, got {choice!r}")
    return choice


def backend_choice() -> str:
    """The requested attention backend from PDCLUSTER_ATTENTION: auto (default), kernel, gather or triton."""
    return _choice(ENV, BACKENDS)


def linear_choice() -> str:
    """The requested linear backend from PDCLUSTER_LINEAR: auto (default), kernel or onednn."""
    return _choice(LINEAR_ENV, LINEAR_BACKENDS)


def _module() -> ModuleType | None:
    global _loaded, _tried
    if not _tried:
        _tried = True
        path = BUILD_DIR / f"{module_name()}.so"
        try:
            _loaded = _import(path)
        except (ImportError, OSError) as e:
            log.warning("compiled kernels not available (%s: %s); attention uses the pure-torch gather path and linear "
                        "layers oneDNN's. Build them with `python -m engine.kernels build` (scripts/install.sh does).",
                        path, e)
    return _loaded


def _pick(env: str, choice: str, fallback: str) -> ModuleType | None:
    if choice == fallback:
        return None
    mod = _module()
    if mod is None and choice == "kernel":
        raise RuntimeError(f"{env}=kernel but the kernels are not built (python -m engine.kernels build)")
    return mod


def attention_kernel() -> ModuleType | None:
    """The built module for attention, or None when it is not built (logged once) or PDCLUSTER_ATTENTION is gather
    or triton (neither uses the compiled CPU kernel)."""
    choice = backend_choice()
    return None if choice == "triton" else _pick(ENV, choice, "gather")


def linear_kernel() -> ModuleType | None:
    """The built module for linear layers, or None when it is not built (logged once) or PDCLUSTER_LINEAR=onednn."""
    return _pick(LINEAR_ENV, linear_choice(), "onednn")


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
        # NOTE: not fatal for the install: the engine runs on the gather path and oneDNN without the kernels.
        print(f"WARNING: {e}\nthe engine will use the pure-torch attention path and oneDNN's linear", file=sys.stderr)
        return 1
    print(f"kernels built: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
