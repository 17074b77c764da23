"""scripts/slim_wheels.py on a small wheel made here: what it drops leaves the archive and the RECORD, a vendored
package's RECORD stays a plain file, modes survive, and pip installs the result (a wheel whose own RECORD went
missing was refused with `OSError: RECORD`: the rehearsal found it in Ray's)."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _slim_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("slim_wheels", ROOT / "scripts" / "slim_wheels.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _entry(name: str, data: bytes, mode: int = 0o644) -> tuple[zipfile.ZipInfo, bytes]:
    info = zipfile.ZipInfo(name)
    info.external_attr = (stat.S_IFREG | mode) << 16
    return info, data


def _record(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def _wheel(folder: Path) -> Path:
    """ray-9.9.9: a kept module, a 'jar' to drop, an executable, a vendored dist-info with its own RECORD."""
    files = [_entry("ray/__init__.py", b"VERSION = '9.9.9'\n"), _entry("ray/jars/big.jar", b"x" * 4096),
             _entry("ray/core/src/ray/raylet/raylet", b"#!/bin/sh\necho raylet\n", 0o755),
             _entry("ray/thirdparty_files/dep-1.0.dist-info/RECORD", b"dep/__init__.py,,\n"),
             _entry("ray-9.9.9.dist-info/METADATA", b"Metadata-Version: 2.1\nName: ray\nVersion: 9.9.9\n"),
             _entry("ray-9.9.9.dist-info/WHEEL", b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")]
    record = "".join(_record(i.filename, d) for i, d in files) + "ray-9.9.9.dist-info/RECORD,,\n"
    path = folder / "ray-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for info, data in [*files, _entry("ray-9.9.9.dist-info/RECORD", record.encode())]:
            z.writestr(info, data)
    return path


def test_a_slimmed_wheel_drops_what_it_names_keeps_modes_and_installs(tmp_path):
    path = _wheel(tmp_path)
    _slim_module().main([str(tmp_path)])
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        record = z.read("ray-9.9.9.dist-info/RECORD").decode()
        raylet_mode = z.getinfo("ray/core/src/ray/raylet/raylet").external_attr >> 16
    assert "ray/jars/big.jar" not in names and "ray/jars/big.jar" not in record
    assert "ray/thirdparty_files/dep-1.0.dist-info/RECORD" in names  # a vendored package's, kept as a file
    assert "ray/__init__.py" in record and raylet_mode & 0o111
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                           "--target", str(target), str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert os.access(target / "ray" / "core" / "src" / "ray" / "raylet" / "raylet", os.X_OK)
    assert not (target / "ray" / "jars").exists()
