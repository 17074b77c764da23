"""KV transfer with GPU KV pools (marked gpu; skipped without CUDA, so never in CI; scripts/gpu-check.sh runs it).

One GPU: two engines with their KV pools on the GPU, in one process. The `local` transport moves each layer from
the sender's GPU pool straight into the blocks the receiver reserved in its GPU pool (checked on the device, as the
torch transport's NCCL path checks them); the `torch` transport with gloo carries the same layers as host tensors
(gloo's send/recv take CPU tensors only), read from and written into the GPU pools; `nixl` writes each layer from the
sender's GPU pool into the receiver's with NIXL WRITE (UCX's copy streams, not the engine's) as the prefill's layer
hooks fire, each behind a ~10 ms sleep queued on the engine's stream so that the host is far ahead of the GPU, as in a
long prefill. What one GPU cannot show: the
torch transport's NCCL path itself (NCCL refuses two ranks on one GPU), so its test needs a second GPU: two
processes, one GPU each, with the engines' pools on the CPU (staged through the GPU) and on the GPU (no host copy).
"""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from kv_transfer import ReceiverEndpoint, TransferConfig, TransferState, payload
from tests.helpers import (
    free_blocks,
    greedy,
    layer_sender,
    open_kv_sender,
    prefill_layerwise,
    random_prompts,
    run_alone,
    run_to_completion,
)

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PROMPT = random_prompts(1, [90], vocab=1000, seed=5)[0]
FIRST = SamplingParams(max_tokens=1, temperature=0)


@needs_cuda
def test_crc_and_layout_survive_a_trip_through_the_gpu(tiny):
    engine = LLMEngine(tiny, EngineConfig(num_blocks=16, num_threads=1))
    layer = torch.randn(2, 5, *engine.kv_layout.block_shape)
    back = layer.to("cuda").cpu()
    assert payload.crc32c(back) == payload.crc32c(layer)
    assert back.shape == (2, 5, *engine.kv_layout.block_shape)


CUDA_ENGINE = dict(device="cuda", dtype="float32", num_blocks=64, max_num_seqs=4, enforce_eager=True, num_threads=1)
GPU_PATHS: dict[str, tuple[dict[str, str], dict[str, str]]] = {  # transport -> (receiver, sender) config
    "local": ({}, {}),
    "torch": ({"torch_backend": "gloo", "torch_device": "cpu"}, {}),
    # NOTE: NIXL WRITE from the sending pool in VRAM as each layer's hook fires, the host ahead of the GPU: the
    # sender waits for the layer's event (nixl_transport.layer_ready), or it would write blocks not computed yet
    "nixl": ({}, {}),
}


@pytest.fixture(scope="module")
def tiny_cuda():
    from engine.loader import load_model

    return load_model("tiny", device="cuda", dtype="float32")


@needs_cuda
@pytest.mark.parametrize("transport", list(GPU_PATHS))
def test_kv_moves_from_a_gpu_pool_into_a_gpu_pool(tiny_cuda, transport):
    from kv_transfer.transports import nixl_load

    if transport == "nixl" and nixl_load.unavailable() is not None:
        pytest.skip(f"nixl: {nixl_load.unavailable()}")
    receiving, sending = GPU_PATHS[transport]
    b = LLMEngine(tiny_cuda, EngineConfig(**CUDA_ENGINE))  # type: ignore[arg-type]
    ep = ReceiverEndpoint(b, TransferConfig(transport=transport, **receiving), local_name=f"gpu-pools-{transport}")
    try:
        a = LLMEngine(tiny_cuda, EngineConfig(**CUDA_ENGINE))  # type: ignore[arg-type]
        assert a.runner.kv.device.type == b.runner.kv.device.type == "cuda"
        baseline = free_blocks(b)
        sender = open_kv_sender(transport, ep.address, a, "r", PROMPT, **sending)
        send = layer_sender(a, sender, PROMPT)

        def behind_the_gpu(layer: int) -> None:
            # NOTE: the GPU sleeps before it computes the layers after this one: their hooks fire on the host while
            # their K/V are not written yet; a sender must wait for the engine's stream (nixl: its layer events)
            torch.cuda._sleep(20_000_000)
            send(layer)

        first = prefill_layerwise(a, sender, PROMPT, FIRST, layers=behind_the_gpu)
        assert sender.wait(30) is TransferState.DONE, sender.error
        assert ep.receiver.wait("r", 10) is TransferState.DONE
        ep.receiver.take("r", greedy(8))
        assert first + run_to_completion(b)["r"].token_ids[1:] == run_alone(tiny_cuda, PROMPT, greedy(8),
                                                                            **CUDA_ENGINE)
        assert free_blocks(b) == baseline
    finally:
        ep.close()


def _nccl_receiver(conn, pools: str) -> None:  # spawned; sees only the second GPU (set before CUDA initialises)
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    from engine.loader import load_model

    b = LLMEngine(load_model("tiny", device=pools, dtype="float32"),
                  EngineConfig(num_blocks=64, num_threads=1, device=pools, dtype="float32"))
    ep = ReceiverEndpoint(b, TransferConfig(transport="torch", torch_backend="nccl", torch_device="cuda"))
    conn.send(ep.address)
    rid = conn.recv()
    assert ep.receiver.wait(rid, 60) is TransferState.DONE, ep.receiver.error(rid)
    ep.receiver.take(rid, greedy(8))
    conn.send(run_to_completion(b)[rid].token_ids)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs for two ranks")
@pytest.mark.parametrize("pools", ["cpu", "cuda"])  # cuda: from and into the GPU pools, no host copy
def test_nccl_round_trip_between_two_gpus(tiny, pools):
    import multiprocessing as mp

    from engine.loader import load_model

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nccl_receiver, args=(child, pools), daemon=True)
    proc.start()
    try:
        assert parent.poll(120)
        address = parent.recv()
        loaded = tiny if pools == "cpu" else load_model("tiny", device="cuda", dtype="float32")
        a = LLMEngine(loaded, EngineConfig(num_blocks=64, num_threads=1, device=pools, dtype="float32"))
        sender = open_kv_sender("torch", address, a, "r", PROMPT, torch_backend="nccl", torch_device="cuda:0")
        first = prefill_layerwise(a, sender, PROMPT, FIRST)
        assert sender.wait(60) is TransferState.DONE, sender.error
        parent.send("r")
        assert parent.poll(60)
        # NOTE: the reference decodes where the receiver did (CPU and GPU float32 may part at a near-tie)
        assert first + parent.recv()[1:] == run_alone(loaded, PROMPT, greedy(8), device=pools, dtype="float32")
    finally:
        proc.kill()
