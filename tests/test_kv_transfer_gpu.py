"""The torch transport with CUDA tensors (marked gpu; skipped without CUDA, so never in CI).

One GPU: layers are staged from the CPU KV pool onto the GPU, sent, received into GPU buffers and staged back
(gloo carries them between the two endpoints in this process). Two or more GPUs: the NCCL path between two
processes, one GPU each. NCCL refuses two ranks on one GPU, so that test needs a second GPU.
"""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from kv_transfer import ReceiverEndpoint, TransferConfig, TransferState, payload
from tests.helpers import (
    free_blocks,
    greedy,
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


@needs_cuda
def test_torch_transport_stages_layers_through_cuda(tiny):
    config = TransferConfig(transport="torch", torch_backend="gloo", torch_device="cuda")
    b = LLMEngine(tiny, EngineConfig(num_blocks=64, num_threads=1))
    ep = ReceiverEndpoint(b, config)
    try:
        a = LLMEngine(tiny, EngineConfig(num_blocks=64, num_threads=1))
        baseline = free_blocks(b)
        sender = open_kv_sender("torch", ep.address, a, "r", PROMPT, torch_device="cuda")
        first = prefill_layerwise(a, sender, PROMPT, FIRST)
        assert sender.wait(30) is TransferState.DONE, sender.error
        assert ep.receiver.wait("r", 10) is TransferState.DONE
        ep.receiver.take("r", greedy(8))
        assert first + run_to_completion(b)["r"].token_ids[1:] == run_alone(tiny, PROMPT, greedy(8))
        assert free_blocks(b) == baseline
    finally:
        ep.close()


def _nccl_receiver(conn) -> None:  # spawned; sees only the second GPU (set before CUDA initialises)
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = "1"
    from engine.loader import load_model

    b = LLMEngine(load_model("tiny"), EngineConfig(num_blocks=64, num_threads=1))
    ep = ReceiverEndpoint(b, TransferConfig(transport="torch", torch_backend="nccl", torch_device="cuda"))
    conn.send(ep.address)
    rid = conn.recv()
    assert ep.receiver.wait(rid, 60) is TransferState.DONE, ep.receiver.error(rid)
    ep.receiver.take(rid, greedy(8))
    conn.send(run_to_completion(b)[rid].token_ids)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs for two ranks")
def test_nccl_round_trip_between_two_gpus(tiny):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nccl_receiver, args=(child,), daemon=True)
    proc.start()
    try:
        assert parent.poll(120)
        address = parent.recv()
        a = LLMEngine(tiny, EngineConfig(num_blocks=64, num_threads=1))
        sender = open_kv_sender("torch", address, a, "r", PROMPT, torch_backend="nccl", torch_device="cuda:0")
        first = prefill_layerwise(a, sender, PROMPT, FIRST)
        assert sender.wait(60) is TransferState.DONE, sender.error
        parent.send("r")
        assert parent.poll(60)
        assert first + parent.recv()[1:] == run_alone(tiny, PROMPT, greedy(8))
    finally:
        proc.kill()
