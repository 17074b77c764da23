"""`bench transfer`'s scattered case: NIXL WRITE of 30 layers x 32 scattered 64 KiB blocks between two processes.

The KV pools of the engine have small blocks (SmolLM2: 12 KiB) and a fresh receiver reserves contiguous runs, which
the transport writes as few large descriptors; this case is the other end: both sides' block ids drawn at random
from a 64-block pool per layer (seldom a run: about one descriptor per block), one WRITE per layer with a
notification, as the transport posts them (`Agent.write` of `kv_transfer.transports.nixl_agent`), both pools in huge
pages as the engine's are. Timed until the receiver has every layer's notification; no checksums (the data plane
alone). Compared by the caller with raw TCP of the same bytes.
"""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import numpy as np
import torch

from engine import host_memory

LAYERS, POOL_BLOCKS, SENT, BLOCK = 30, 64, 32, 64 << 10  # the case: 30 layers x 32 blocks of 64 KiB
SHAPE = (LAYERS, 2, POOL_BLOCKS, BLOCK // 4)  # float32 words


def nbytes() -> int:
    return LAYERS * 2 * SENT * BLOCK


def scatter_sink(conn: Connection) -> None:
    """Process body: a registered pool; per round, waits for every layer's notification and acks."""
    from kv_transfer.transports import nixl_agent

    agent = nixl_agent.agent()
    kv = host_memory.zeros(SHAPE, torch.float32)  # as the engine's KV pool
    pool = agent.pool(kv)
    conn.send((agent.name, agent.metadata, kv.data_ptr(), pool.num_blocks, pool.block_nbytes))
    while conn.recv() is not None:
        got = 0
        while got < LAYERS:
            got += sum(len(m) for m in agent.notifications().values())
        conn.send("k")


def scatter_round(peer_conn: Connection, peer_info: tuple, rounds: int) -> list[float]:  # type: ignore[type-arg]
    """Seconds per round of writing every layer's scattered blocks into the sink."""
    from kv_transfer.transports import nixl_agent

    name, metadata, addr, pool_blocks, block_nbytes = peer_info
    agent = nixl_agent.agent()
    src = host_memory.zeros(SHAPE, torch.float32).normal_()
    pool = agent.pool(src)
    peer = agent.peer(name, metadata, addr, LAYERS * 2, pool_blocks, block_nbytes, "DRAM", 0)
    rng = np.random.default_rng(0)
    nx, runs = agent.nixl, []
    for _ in range(rounds):
        src_ids = [rng.choice(POOL_BLOCKS, SENT, replace=False) for _ in range(LAYERS)]
        dst_ids = [rng.choice(POOL_BLOCKS, SENT, replace=False) for _ in range(LAYERS)]
        peer_conn.send("go")
        t0 = time.perf_counter()
        handles = []
        for layer in range(LAYERS):
            h = agent.write(pool, peer, layer, src_ids[layer], dst_ids[layer], f"{layer}".encode())
            nx.transfer(h)
            handles.append(h)
        for h in handles:
            while nx.check_xfer_state(h) == "PROC":
                pass
            nx.release_xfer_handle(h)
        if peer_conn.recv() != "k":
            raise RuntimeError("scatter sink did not ack")
        runs.append(time.perf_counter() - t0)
    return runs
