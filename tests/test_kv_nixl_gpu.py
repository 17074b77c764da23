"""nixl with GPU KV pools (marked gpu; skipped without CUDA or NIXL, so never in CI; scripts/gpu-check.sh runs it).

Two processes on one GPU, each with a KV pool in VRAM shaped like the engine's ([layers, 2, blocks, 16, 3, 64] fp32,
SmolLM2-135M's block): the sending process writes 128 blocks of every layer into the receiver's pool through the
same agent code as the transport (pool registered once, descriptor lists prepared once, one WRITE per layer with a
notification carrying the layer's device checks, `Agent.write`'s one descriptor per run of blocks), UCX picking
cuda_ipc. The receiver checks every layer. The figure printed is the second round's GB/s (the first pays the pair's
first use; its figure is kept too, and a third round's with one descriptor per block) against a device-to-device
copy of the same bytes in the sending process.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kv_transfer.transports import cuda_ipc, nixl_agent, nixl_load
from kv_transfer.transports.nixl_checks import check_stream

pytestmark = pytest.mark.gpu
if torch.cuda.is_available():
    # NOTE: UCX reads its log level when its library loads (NIXL's import, in `needs` below): the endpoints'
    # lanes, as the figure's explanation, are logged at info level (never on a machine without CUDA: CI's suite)
    os.environ.setdefault("UCX_LOG_LEVEL", "info")
    os.environ.setdefault("UCX_PROTO_INFO", "y")  # NOTE: and the protocol each message size of a put takes
needs = pytest.mark.skipif(not torch.cuda.is_available() or nixl_load.unavailable() is not None,
                           reason="needs a CUDA GPU and NIXL")
SHAPE = (30, 2, 256, 16, 3, 64)  # [layers, K/V, pool blocks, block_size, KVH, D]
SENT = 128  # blocks per layer sent
ROUNDS = 4  # the same blocks sent 3 times through NIXL: the first pays the pair's first use, the second (in runs, as
# the transport writes) is the figure, the third writes a descriptor per block (for comparison); the 4th goes through
# the direct lane (CUDA IPC) into other blocks


def _ucx_lanes(path: str) -> list[str]:
    """The endpoint configurations UCX logged into `path` (`nixl_agent.ucx_lanes`), at most 8."""
    try:
        with open(path, errors="replace") as f:
            return nixl_agent.ucx_lanes(f)[:8]
    except OSError as e:
        return [f"no UCX log: {e}"]


def _put_protocols(path: str) -> list[str]:
    """UCX_PROTO_INFO's tables of puts from or into GPU memory (the rows after each title: the message sizes and
    the protocol and lane each takes, e.g. `0..inf | zero-copy | cuda_ipc/cuda`)."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.rstrip() for line in f]
    except OSError as e:
        return [f"no UCX log: {e}"]
    out: list[str] = []
    for i, line in enumerate(lines):
        if "ucp_put" in line and "cuda" in line:
            out += [row.split("]", 2)[-1].strip()[:160] for row in lines[i:i + 8] if "|" in row]
    return out[:24]


@contextlib.contextmanager
def _stdout_to(path: str) -> Iterator[None]:
    """This process's file descriptor 1 into `path` meanwhile: UCX prints its log there (UCX_LOG_FILE gave empty
    files with NIXL's UCX build on the H200, 2026-11-30)."""
    sys.stdout.flush()
    saved = os.dup(1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.close(fd)
    try:
        yield
    finally:
        _flush_c_stdio()
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_stdio() -> None:
    """UCX prints through C's buffered stdout: flushed into the file it goes to now, not the next one."""
    ctypes.CDLL(None).fflush(None)


def _receiver(conn) -> None:  # type: ignore[no-untyped-def]
    try:

        from kv_transfer.transports.nixl_checks import layer_check

        # NOTE: UCX reads these when this process's agent starts (below): its endpoint configurations, as the figure's
        # explanation, go into the test's record
        log_path = os.path.join(tempfile.gettempdir(), f"pdc-ucx-{os.getpid()}.log")
        os.environ.setdefault("UCX_LOG_LEVEL", "info")
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log_fd, 1)  # NOTE: this child's stdout: UCX prints there (`_stdout_to`)
        kv = torch.zeros(SHAPE, device="cuda")
        agent = nixl_agent.agent()
        pool = agent.pool(kv)
        ids = {"n": np.arange(SENT, 2 * SENT, dtype=np.int64), "d": np.arange(SENT, dtype=np.int64)}  # NIXL, direct
        conn.send((agent.name, agent.metadata, kv.data_ptr(), pool.num_blocks, pool.block_nbytes, pool.device,
                   cuda_ipc.export(kv)))
        landed: dict[str, bool] = {}
        seen = 0
        deadline = time.monotonic() + 60
        # NOTE: NIXL is driven here (no progress thread) until every round's notifications are in, so the sender's
        # timed rounds meet a receiver as active as the first
        while seen < ROUNDS * SHAPE[0] and time.monotonic() < deadline:
            for msgs in agent.notifications().values():
                for msg in msgs:
                    seen += 1
                    lane, layer_s, ck, cv = msg.decode().split(":")
                    layer = int(layer_s)
                    if f"{lane}{layer}" in landed:
                        continue
                    torch.cuda.synchronize()
                    landed[f"{lane}{layer}"] = (
                        layer_check(kv[layer, 0], ids[lane], f"{layer}/0", like=ck) == ck and
                        layer_check(kv[layer, 1], ids[lane], f"{layer}/1", like=cv) == cv)
        _flush_c_stdio()
        conn.send(("landed", landed, _ucx_lanes(log_path)))
        conn.recv()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _send_all(agent: nixl_agent.Agent, pool: nixl_agent.Pool, peer: nixl_agent.Peer, checks: list[list[str]],
              src_ids: np.ndarray, dst_ids: np.ndarray, per_block: bool = False, lane: str = "n") -> float:
    """One WRITE per layer (its notification carries the layer's checks); seconds until every one is done. As the
    transport writes (`Agent.write`: one descriptor per run of blocks, K then V), or `per_block`: one descriptor per
    block from the prepared lists (UCX then makes one copy per 12 KiB block)."""
    nx = agent.nixl
    t0 = time.perf_counter()
    handles = []
    for layer in range(SHAPE[0]):
        notif = f"{lane}:{layer}:{checks[layer][0]}:{checks[layer][1]}".encode()
        if per_block:
            base_l, base_r = layer * 2 * pool.num_blocks, layer * 2 * peer.num_blocks
            local = np.concatenate([base_l + src_ids, base_l + pool.num_blocks + src_ids]).astype(np.int32)
            remote = np.concatenate([base_r + dst_ids, base_r + peer.num_blocks + dst_ids]).astype(np.int32)
            h = nx.make_prepped_xfer("WRITE", pool.dlist, local, peer.dlist, remote, notif)
        else:
            h = agent.write(pool, peer, layer, src_ids, dst_ids, notif)
        assert nx.transfer(h) != "ERR"
        handles.append(h)
    for h in handles:
        while (state := nx.check_xfer_state(h)) == "PROC":
            pass
        assert state == "DONE"
        nx.release_xfer_handle(h)
    return time.perf_counter() - t0


def _copy_all(agent: nixl_agent.Agent, peer_name: str, dst: torch.Tensor, src: torch.Tensor,
              checks: list[list[str]], src_ids: np.ndarray, dst_ids: np.ndarray) -> float:
    """The direct lane, as the transport's `_copy_direct` runs it: each layer's runs copied GPU to GPU into the
    receiver's pool mapped here, on a side stream, then its notification; seconds for all layers."""
    stream = check_stream(src.device)
    ls, rs, n = nixl_agent.runs(src_ids, dst_ids)
    t0 = time.perf_counter()
    for layer in range(SHAPE[0]):
        with torch.cuda.stream(stream):
            cuda_ipc.copy_layer(dst, src, layer, ls, rs, n)
        stream.synchronize()
        agent.nixl.send_notif(peer_name, f"d:{layer}:{checks[layer][0]}:{checks[layer][1]}".encode())
    return time.perf_counter() - t0


@needs
def test_kv_moves_between_two_processes_on_one_gpu_through_nixl(record_property):
    from kv_transfer.transports.nixl_checks import layer_check

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child,), daemon=True)
    proc.start()
    try:
        assert conn.poll(120), "receiver did not start"
        msg = conn.recv()
        assert msg[0] != "error", msg[1]
        name, metadata, addr, pool_blocks, block_nbytes, device, ipc_desc = msg
        src = torch.randn(SHAPE, device="cuda")
        src_ids, dst_ids = np.arange(SENT, dtype=np.int64), np.arange(SENT, 2 * SENT, dtype=np.int64)
        checks = [[layer_check(src[layer, w], src_ids, f"{layer}/{w}") for w in (0, 1)] for layer in range(SHAPE[0])]
        sender_log = os.path.join(tempfile.gettempdir(), f"pdc-ucx-{os.getpid()}.log")
        # NOTE: the sender makes its endpoint to the receiver when it loads the receiver's metadata (`peer`), and
        # the first round pays UCX's first use of the pair (the peer's memory handles opened, cuda_ipc mappings
        # made); the figure is the second, as a worker's steady state sends
        with _stdout_to(sender_log):
            agent = nixl_agent.agent()
            pool = agent.pool(src)
            peer = agent.peer(name, metadata, addr, SHAPE[0] * 2, pool_blocks, block_nbytes, "VRAM", device)
            send_all = functools.partial(_send_all, agent, pool, peer, checks, src_ids, dst_ids)
            first_s = send_all()
        nbytes = SHAPE[0] * 2 * SENT * block_nbytes
        nixl_s = send_all()
        per_block_s = send_all(per_block=True)
        # NOTE: the direct lane (cuda_ipc.py) into other blocks (0 .. SENT-1, zeros until written), so the receiver's
        # checks see what this lane wrote; where the pool cannot be mapped, that round goes through NIXL instead
        direct_ids = np.arange(SENT, dtype=np.int64)
        mapped = cuda_ipc.mapped(name, ipc_desc, src) if ipc_desc else None
        direct_s = (_copy_all(agent, name, mapped, src, checks, src_ids, direct_ids) if mapped is not None
                    else _send_all(agent, pool, peer, checks, src_ids, direct_ids, lane="d"))
        dst = torch.empty_like(src)
        copy_s = float("inf")
        for _ in range(2):  # NOTE: the second, as NIXL's
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst[:, :, :SENT].copy_(src[:, :, :SENT])
            torch.cuda.synchronize()
            copy_s = time.perf_counter() - t0
        assert conn.poll(60), "receiver did not report"
        kind, landed, lanes = conn.recv()
        assert kind == "landed" and len(landed) == 2 * SHAPE[0] and all(landed.values()), landed
        # NOTE: the figures also go into the JUnit XML (scripts/gpu-check.sh's summary.json reads them from there)
        for key, value in (("mb", nbytes / 1e6), ("nixl_gb_s", nbytes / nixl_s / 1e9),
                           ("first_round_gb_s", nbytes / first_s / 1e9), ("per_block_gb_s", nbytes / per_block_s / 1e9),
                           ("copy_gb_s", nbytes / copy_s / 1e9), ("ratio_to_copy", copy_s / nixl_s),
                           ("direct_gb_s", nbytes / direct_s / 1e9), ("direct_ratio_to_copy", copy_s / direct_s)):
            record_property(key, round(value, 3))
        record_property("cuda_ipc", "mapped" if mapped is not None else cuda_ipc.refused(name) or "not offered")
        record_property("ucx_receiver_lanes", " | ".join(lanes) or "none logged")
        record_property("ucx_sender_lanes", " | ".join(_ucx_lanes(sender_log)) or "none logged")
        record_property("ucx_put_protocols", " / ".join(_put_protocols(sender_log)) or "none logged")
        print(f"\n[nixl gpu] {nbytes / 1e6:.0f} MB, {SHAPE[0]} layers x {SENT} blocks: "
              f"nixl {nbytes / nixl_s / 1e9:.1f} GB/s (first round {nbytes / first_s / 1e9:.1f}), "
              f"device-to-device copy {nbytes / copy_s / 1e9:.1f} GB/s, ratio {copy_s / nixl_s:.2f}; direct lane "
              f"{nbytes / direct_s / 1e9:.1f} GB/s ({'CUDA IPC' if mapped is not None else cuda_ipc.refused(name)})")
        conn.send("stop")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kv_on_the_gpu_is_checked_where_it_lives():
    """The torch transport from and into GPU pools checks layers on the device: same bytes, same check; one word
    changed, another check (the NCCL path between two GPU pools itself needs two GPUs and the engine on CUDA)."""
    from kv_transfer import payload

    layer = torch.randn(8, 16, 3, 64, device="cuda")
    same = layer.clone()
    assert payload.checksum("t", 3, 0, 0, 8, layer) == payload.checksum("t", 3, 0, 0, 8, same)
    same.view(-1)[100] += 1.0
    assert payload.checksum("t", 3, 0, 0, 8, layer) != payload.checksum("t", 3, 0, 0, 8, same)
    assert payload.checksum("t", 3, 0, 0, 8, layer) != payload.checksum("t", 4, 0, 0, 8, layer)
