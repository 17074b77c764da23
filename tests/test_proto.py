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


def test_kv_chunks_framed_by_hand_are_the_protos_kvchunk_both_ways():
    """wire.py frames KVChunk.data itself (no protobuf copy); protobuf must read what it writes and vice versa."""
    from kv_transfer import wire
    from kv_transfer.messages import Chunk
    from kv_transfer.v1 import kv_transfer_pb2 as pb

    chunk, data = Chunk("t-1", 3, 1, 64, 2, 0xDEADBEEF), bytes(range(256)) * 40
    msg = pb.KVChunk.FromString(wire.chunk_to_wire(chunk, memoryview(data)))
    assert (msg.transfer_id, msg.layer, msg.kv, msg.first_block, msg.num_blocks, msg.crc32c) == ("t-1", 3, 1, 64, 2,
                                                                                               0xDEADBEEF)
    assert msg.data == data
    data_first = pb.KVChunk(data=data).SerializeToString() + pb.KVChunk(
        transfer_id="t-1", layer=3, kv=1, first_block=64, num_blocks=2, crc32c=0xDEADBEEF).SerializeToString()
    for raw in (msg.SerializeToString(), data_first):
        got, view = wire.chunk_from_wire(raw)
        assert got == chunk and bytes(view) == data
