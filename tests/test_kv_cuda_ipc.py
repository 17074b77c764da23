"""The nixl transport's direct lane between GPU pools of one node (kv_transfer/transports/cuda_ipc.py), on the CPU:
what is offered and refused, that the description travels in the handshake, and the lane's path through the
transport with only the CUDA IPC open stood in for. The lane itself (a pool mapped through CUDA IPC, each layer
copied GPU to GPU) runs in tests/test_kv_nixl_gpu.py on a GPU."""

from __future__ import annotations

import json
import logging
import os
import socket

import torch

from kv_transfer import wire
from kv_transfer.messages import NixlTarget, Prepared
from kv_transfer.transports import cuda_ipc

SHAPE = [2, 2, 8, 16, 3, 64]


def _desc(**over: object) -> dict:
    desc = {"host": socket.gethostname(), "pid": os.getpid() + 1, "shape": SHAPE, "dtype": "float32"}
    desc.update(over)
    return desc


def test_a_host_pool_is_not_offered():
    assert cuda_ipc.export(torch.zeros(SHAPE)) == b""


def test_a_pool_that_cannot_be_mapped_here_says_why():
    like = torch.zeros(SHAPE)
    assert "not on this node" in cuda_ipc.refusal(_desc(host="elsewhere"), like)
    assert "in this process" in cuda_ipc.refusal(_desc(pid=os.getpid()), like)
    assert "differs" in cuda_ipc.refusal(_desc(shape=[2, 2, 9, 16, 3, 64]), like)
    assert "differs" in cuda_ipc.refusal(_desc(dtype="bfloat16"), like)
    assert "not on a GPU" in cuda_ipc.refusal(_desc(), like)


def test_a_refused_pool_is_written_through_nixl_and_logged_once(caplog):
    like = torch.zeros(SHAPE)
    raw = json.dumps(_desc()).encode()
    try:
        with caplog.at_level(logging.INFO, logger=cuda_ipc.__name__):
            assert cuda_ipc.mapped("recv-a", raw, like) is None
            assert cuda_ipc.mapped("recv-a", raw, like) is None
        assert [r.getMessage() for r in caplog.records] == [
            "nixl-cuda-ipc: KV to recv-a goes through NIXL: the sender's pool is not on a GPU"]
        assert cuda_ipc.refused("recv-a") == "the sender's pool is not on a GPU"
        assert cuda_ipc.mapped("recv-b", b"not json", like) is None
        assert cuda_ipc.refused("recv-b").startswith("JSONDecodeError")
    finally:
        cuda_ipc.forget("recv-a")
        cuda_ipc.forget("recv-b")
    assert cuda_ipc.refused("recv-a") is None
    cuda_ipc.refuse("recv-c", "a copy failed: RuntimeError: x")  # NOTE: a mapped pool whose copy failed
    try:
        assert cuda_ipc.mapped("recv-c", json.dumps(_desc()).encode(), like) is None
        assert cuda_ipc.refused("recv-c") == "a copy failed: RuntimeError: x"
    finally:
        cuda_ipc.forget("recv-c")


def test_the_description_travels_in_the_handshake():
    target = NixlTarget("recv", b"meta", 1234, 8, "VRAM", 0, [3, 4], [], b'{"host": "h"}')
    back = wire.prepared_from_proto(wire.prepared_to_proto(Prepared("t1", 0, 2, None, target)))
    assert back.nixl == target
    plain = NixlTarget("recv", b"", 1234, 8, "DRAM", 0, [3, 4])
    assert wire.prepared_from_proto(wire.prepared_to_proto(Prepared("t1", 0, 2, None, plain))).nixl == plain


def test_the_direct_lane_copies_each_layer_and_the_receiver_checks_what_landed(tiny, monkeypatch):
    """The sender's side of the lane as the transport runs it (runs of blocks copied into the receiver's pool, then
    each layer's notification with its checks), and the receiver's checks and commit, with NIXL's WRITE made to fail:
    only the CUDA IPC open is stood in for (the receiver's pool is in this process), which the GPU test runs."""
    from kv_transfer.endpoint import ReceiverEndpoint
    from kv_transfer.state import TransferConfig, TransferState
    from kv_transfer.transports import nixl_agent
    from tests.helpers import free_blocks, greedy, open_kv_sender, prefill_layerwise, random_prompts, run_alone
    from tests.test_kv_transfer import decode_on, engine

    prompt = random_prompts(1, [90], vocab=1000, seed=11)[0]
    want = run_alone(tiny, prompt, greedy(8))
    ep = ReceiverEndpoint(engine(tiny), TransferConfig(transport="nixl"), local_name="nixl-direct")
    try:
        ep.side.cuda_ipc = b"{}"  # NOTE: offered (a host pool offers nothing): the sender asks `mapped` for it
        opened = []
        monkeypatch.setattr(cuda_ipc, "mapped", lambda agent, desc, like: opened.append(desc) or ep.side.pool.kv)

        def no_write(*args: object) -> None:
            raise AssertionError("a NIXL WRITE on the direct lane")

        monkeypatch.setattr(nixl_agent.Agent, "write", no_write)
        a = engine(tiny)
        b_free = free_blocks(ep.receiver.engine)
        sender = open_kv_sender("nixl", ep.address, a, "r", prompt)
        first = prefill_layerwise(a, sender, prompt, greedy(1))
        assert sender.wait(10) is TransferState.DONE, sender.error
        assert opened == [b"{}"] and sender.bytes_sent == a.kv_layout.num_layers * a.kv_layout.layer_nbytes(6)
        assert first == want[:1] and decode_on(ep, "r", 8) == want
        assert free_blocks(ep.receiver.engine) == b_free and ep.receiver.num_inflight == 0
    finally:
        ep.close()


def test_the_lanes_ucx_logged_are_read_from_its_info_lines():
    """The endpoint configurations as UCX logged them on the H200 (2026-11-30), not its tables' rows."""
    from kv_transfer.transports.nixl_agent import ucx_lanes

    lines = ["[1796001312.924648] [vm:10061:0]      ucp_worker.c:1997 UCX  INFO    pdc-vm-10061-eea4b1cd intra-node "
             "cfg#2 rma_am(tcp/lo)  amo_am(tcp/lo)  device(cuda_ipc/cuda)  am(tcp/lo cma/memory cuda_ipc/cuda)  "
             "ka(tcp/lo)",
             "[1796001312.925220] [vm:10061:0]   | pdc-vm-10061-eea4b1cd intra-node cfg#2                   |",
             "[1796001312.912125] [vm:10061:0]  cuda_ipc_iface.c:320  UCX  DEBUG cuda-ipc get zcopy disabled"]
    assert ucx_lanes(lines) == ["pdc-vm-10061-eea4b1cd intra-node cfg#2 rma_am(tcp/lo)  amo_am(tcp/lo)  "
                                "device(cuda_ipc/cuda)  am(tcp/lo cma/memory cuda_ipc/cuda)  ka(tcp/lo)"]
