"""The nixl transport's direct lane between two GPU pools of one node: the decode pool shared through CUDA IPC.

On an H200 shared by two workers (BENCHMARKS.md, issue 38), NIXL's WRITE between their VRAM pools moved 1.7-2.8 GB/s
against a 278-902 GB/s device copy: UCX set up a cuda_ipc lane, yet larger descriptors went slower than small ones,
as through a staged copy. So where both pools are GPU memory of one node, the receiver also hands out its pool as a
CUDA IPC handle (torch's own sharing of CUDA storage, as torch.multiprocessing sends tensors), the sender maps it
once per receiver and copies each layer's runs of blocks into it on its own stream: a device-to-device copy. The
layer's notification then goes as a NIXL notification of its own (`send_notif`), with the same checks, so the
receiver's side (checks, fence, commit) is the same whichever lane carried the bytes.

Where the handle cannot be opened (the pools on GPUs that cannot see each other, another node, the same process, a
sandbox that refuses IPC) the sender logs why, once per receiver, and writes through NIXL as before.
`PDCLUSTER_NIXL_CUDA_IPC=0` (on the receiver) turns the lane off.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import socket
import threading
from collections.abc import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

_lock = threading.Lock()
_opened: dict[str, torch.Tensor | str] = {}  # receiver agent → its pool mapped here, or why not


def enabled() -> bool:
    return os.environ.get("PDCLUSTER_NIXL_CUDA_IPC", "1") != "0"


def export(kv: torch.Tensor) -> bytes:
    """A description of GPU pool `kv` another process of this node can map (empty for a host pool, or when off)."""
    if kv.device.type != "cuda" or not enabled():
        return b""
    try:
        device, handle, size, offset, ref, ref_offset, event, event_sync = kv.untyped_storage()._share_cuda_()
    except Exception as e:  # noqa: BLE001 - e.g. an allocator setting torch cannot share: senders write through NIXL
        log.warning("nixl-cuda-ipc: this KV pool cannot be shared through CUDA IPC (senders write through NIXL): "
                    "%s: %s", type(e).__name__, e)
        return b""

    def b64(raw: bytes | None) -> str | None:
        return None if raw is None else base64.b64encode(raw).decode()

    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "device": device, "handle": b64(handle),
                       "size": size, "offset": offset, "ref": b64(ref), "ref_offset": ref_offset,
                       "event": b64(event), "event_sync": event_sync, "tensor_offset": kv.storage_offset(),
                       "shape": list(kv.shape), "stride": list(kv.stride()),
                       "dtype": str(kv.dtype).removeprefix("torch.")}).encode()


def refusal(desc: dict, like: torch.Tensor) -> str | None:
    """Why the pool `desc` describes cannot be mapped here to be written from `like` (None: it can be tried)."""
    if desc.get("host") != socket.gethostname():
        return f"the receiver runs on {desc.get('host')}, not on this node"
    if desc.get("pid") == os.getpid():
        return "the receiver is in this process"
    if desc.get("shape") != list(like.shape) or desc.get("dtype") != str(like.dtype).removeprefix("torch."):
        return (f"its pool {desc.get('dtype')} {desc.get('shape')} differs from this one's {like.dtype} "
                f"{list(like.shape)}")
    if like.device.type != "cuda":
        return "the sender's pool is not on a GPU"
    return None


def _open(desc: dict, like: torch.Tensor) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    def raw(key: str) -> bytes | None:
        return None if desc[key] is None else base64.b64decode(desc[key])

    # NOTE: opened on this process's GPU (desc["device"] counts the receiver's visible devices, not ours): the
    # same physical GPU where Ray gives both workers of one GPU the same CUDA_VISIBLE_DEVICES; a pool on a GPU this
    # process cannot reach fails to open, and that receiver is written through NIXL
    with torch.cuda.device(like.device):
        return rebuild_cuda_tensor(torch.Tensor, torch.Size(desc["shape"]), tuple(desc["stride"]),
                                   desc["tensor_offset"], torch.UntypedStorage, like.dtype, like.device.index or 0,
                                   raw("handle"), desc["size"], desc["offset"], False, raw("ref"),
                                   desc["ref_offset"], raw("event"), desc["event_sync"])


def mapped(agent: str, description: bytes, like: torch.Tensor) -> torch.Tensor | None:
    """Receiver `agent`'s pool mapped into this process (opened once per receiver), or None: write through NIXL
    (why is logged once)."""
    with _lock:
        got = _opened.get(agent)
        if got is None:
            try:
                desc = json.loads(description)
                why = refusal(desc, like)
                got = why if why is not None else _open(desc, like)
            except Exception as e:  # noqa: BLE001 - e.g. cudaErrorInvalidDevice, a sandbox refusing IPC: NIXL writes
                got = f"{type(e).__name__}: {e}"
            _opened[agent] = got
            if isinstance(got, str):
                log.warning("nixl-cuda-ipc: KV to %s goes through NIXL: %s", agent, got)
            else:
                log.info("nixl-cuda-ipc: KV to %s is copied GPU to GPU through CUDA IPC", agent)
        return got if isinstance(got, torch.Tensor) else None


def refuse(agent: str, why: str) -> None:
    """Write to receiver `agent` through NIXL from now on (its mapped pool dropped), saying why."""
    with _lock:
        _opened[agent] = why
    log.warning("nixl-cuda-ipc: KV to %s goes through NIXL from now on: %s", agent, why)


def refused(agent: str) -> str | None:
    """Why receiver `agent`'s pool could not be mapped here (None: it was, or was never tried)."""
    with _lock:
        got = _opened.get(agent)
    return got if isinstance(got, str) else None


def forget(agent: str) -> None:
    """Unmap receiver `agent`'s pool (it restarted or stopped answering)."""
    with _lock:
        _opened.pop(agent, None)


def copy_layer(dst: torch.Tensor, src: torch.Tensor, layer: int, local: Sequence[int] | np.ndarray,
               remote: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
    """Layer `layer`'s K and V of each run of blocks (`nixl_agent.runs`) from pool `src` into pool `dst`, on the
    current stream (both pools [layers, 2, blocks, *block_shape])."""
    for first, to, n in zip(local, remote, lengths, strict=True):
        dst[layer, :, int(to) : int(to) + int(n)].copy_(src[layer, :, int(first) : int(first) + int(n)])
