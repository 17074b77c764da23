"""The generated gRPC code in kv_transfer/v1/ and router/v1/ matches proto/ (regenerate with `make proto`)."""

from __future__ import annotations

import pathlib
import runpy

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_generated_code_is_in_sync_with_the_protos(tmp_path):
    generate = runpy.run_path(str(ROOT / "scripts" / "gen_proto.py"))["generate"]
    files = generate(tmp_path)
    assert files, "no generated files"
    for rel in files:
        checked_in = ROOT / rel
        assert checked_in.exists(), f"{rel} is not checked in: run `make proto`"
        assert checked_in.read_text() == (tmp_path / rel).read_text(), f"{rel} is stale: run `make proto`"
