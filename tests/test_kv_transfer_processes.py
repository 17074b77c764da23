"""KV transfer between separate processes: SmolLM2 round trips per transport, and processes killed mid-transfer."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loader import load_model
from kv_transfer import ReceiverEndpoint, TransferConfig, TransferState
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

N = 12
FIRST = SamplingParams(max_tokens=1, temperature=0)
CTX = mp.get_context("spawn")


def _config(model: str) -> EngineConfig:
    return EngineConfig(num_threads=1, num_blocks=64 if model == "tiny" else None, kv_cache_memory_gb=0.25)


def _receiver_child(conn, model: str, transport: str = "torch") -> None:  # a decode-side engine behind an endpoint
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        engine = LLMEngine(load_model(model), _config(model))
        ep = ReceiverEndpoint(engine, TransferConfig(transport=transport))  # serves grpc, and torch or nixl
        conn.send(("ready", ep.address, engine.stats()))
        while True:
            op, *args = conn.recv()
            if op == "stop":
                return
            if op == "stats":
                conn.send(("stats", engine.stats(), ep.receiver.num_inflight))
                continue
            rid, max_tokens = args
            if ep.receiver.wait(rid, 60) is not TransferState.DONE:
                conn.send(("failed", str(ep.receiver.error(rid))))
                continue
            ep.receiver.take(rid, greedy(max_tokens))
            with ep.receiver.engine_lock:
                tokens = run_to_completion(engine)[rid].token_ids
            conn.send(("ok", tokens))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


class Child:
    def __init__(self, target, *args) -> None:  # type: ignore[no-untyped-def]
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()

    def recv(self, timeout: float = 120):  # type: ignore[no-untyped-def]
        assert self.conn.poll(timeout), "child process did not answer"
        msg = self.conn.recv()
        assert msg[0] != "error", msg[1]
        return msg

    def ask(self, *msg):  # type: ignore[no-untyped-def]
        self.conn.send(msg)
        return self.recv()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


@pytest.fixture(scope="module")
def smol_receiver():
    child = Child(_receiver_child, "smollm2")
    _, address, baseline = child.recv(180)
    yield child, address, baseline
    child.conn.send(("stop",))
    child.proc.join(10)
    if child.proc.is_alive():
        child.kill()


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_smollm2_round_trip_between_processes_continues_like_one_engine(smollm2, smol_receiver, transport):
    child, address, baseline = smol_receiver
    prompt = random_prompts(1, [300], seed=21)[0]
    want = run_alone(smollm2, prompt, greedy(N))
    a = LLMEngine(smollm2, _config("smollm2"))
    sender = open_kv_sender(transport, address, a, f"rt-{transport}", prompt)
    first = prefill_layerwise(a, sender, prompt, FIRST)
    assert sender.wait(30) is TransferState.DONE, sender.error
    _, tokens = child.ask("decode", sender.request_id, N)
    assert first == want[:1] and tokens == want
    stats = child.ask("stats")[1]
    assert stats.num_free_blocks == baseline.num_free_blocks and stats.num_reserved == 0


def test_only_missing_blocks_move_with_a_256_token_prefix_cached_on_the_receiver(smollm2, smol_receiver):
    child, address, _ = smol_receiver
    shared = random_prompts(1, [256], seed=22)[0]  # 16 full blocks
    a = LLMEngine(smollm2, _config("smollm2"))
    layout = a.kv_layout
    for i, tail in enumerate(random_prompts(2, [40, 72], seed=23)):
        prompt = shared + tail
        sender = open_kv_sender("grpc", address, a, f"prefix-{i}", prompt)
        first = prefill_layerwise(a, sender, prompt, FIRST)
        assert sender.wait(30) is TransferState.DONE, sender.error
        _, tokens = child.ask("decode", sender.request_id, 4)
        assert tokens == run_alone(smollm2, prompt, greedy(4)) and tokens[:1] == first
    # the second request: 328 tokens = 21 blocks, of which the receiver caches the 16 of the shared prefix
    assert sender.cached_blocks == 16 and sender.num_blocks == 5
    assert sender.bytes_sent == layout.num_layers * layout.layer_nbytes(5)  # 30 layers × 5 blocks × (K + V)


def _sender_child(conn, address: str, transport: str, prompt: list[int]) -> None:  # a prefill side that dies
    try:
        from engine.loader import load_model

        a = LLMEngine(load_model("tiny"), _config("tiny"))
        sender = open_kv_sender(transport, address, a, "doomed", prompt, deadline_s=5)
        send = layer_sender(a, sender, prompt)

        def first_layer_then_die(layer: int) -> None:  # ... one layer, then it is killed before the next
            if layer == 0:
                send(layer)
                time.sleep(0.5)
                conn.send(("sent",))
                time.sleep(600)

        prefill_layerwise(a, sender, prompt, FIRST, layers=first_layer_then_die)
    except BaseException:
        conn.send(("error", traceback.format_exc()))


@pytest.mark.parametrize("transport", ["grpc", "torch", "nixl"])
def test_a_sender_killed_mid_stream_leaves_no_reservation_behind(tiny, transport):
    b = LLMEngine(tiny, _config("tiny"))
    ep = ReceiverEndpoint(b, TransferConfig(transport="nixl" if transport == "nixl" else "torch"))
    try:
        baseline = free_blocks(b)
        prompt = random_prompts(1, [90], vocab=1000, seed=5)[0]
        child = Child(_sender_child, ep.address, transport, prompt)
        child.recv()
        assert free_blocks(b) == baseline - 6 and ep.receiver.poll("doomed") is TransferState.TRANSFERRING
        child.kill()
        killed = time.monotonic()
        while free_blocks(b) != baseline and time.monotonic() - killed < 7:
            time.sleep(0.05)
        assert free_blocks(b) == baseline, "reservation outlived the 5 s deadline"
        assert ep.receiver.poll("doomed") is TransferState.FAILED and ep.receiver.num_inflight == 0
    finally:
        ep.close()


@pytest.mark.parametrize("transport", ["grpc", "torch", "nixl"])
def test_a_killed_receiver_fails_the_sender_fast_and_the_prefill_side_is_idle(tiny, transport):
    child = Child(_receiver_child, "tiny", "nixl" if transport == "nixl" else "torch")
    _, address, _ = child.recv()
    a = LLMEngine(tiny, _config("tiny"))
    baseline = free_blocks(a)
    prompt = random_prompts(1, [90], vocab=1000, seed=5)[0]
    sender = open_kv_sender(transport, address, a, "orphan", prompt)
    send = layer_sender(a, sender, prompt)
    killed: list[float] = []

    def kill_after_the_first_layer(layer: int) -> None:
        send(layer)
        if layer == 0:
            time.sleep(0.5)  # the first layer is through (and a torch pair group exists)
            child.kill()
            killed.append(time.monotonic())

    prefill_layerwise(a, sender, prompt, FIRST, layers=kill_after_the_first_layer)
    assert sender.wait(10) is TransferState.FAILED
    assert time.monotonic() - killed[0] < 5, "the sender should not wait for its 30 s deadline"
    assert free_blocks(a) == baseline


def test_a_frozen_receiver_fails_a_torch_sender_long_before_its_deadline(tiny):
    """A receiver that stops answering (SIGSTOP: a hung host, a node gone without a TCP reset) leaves gloo and the
    commit waiting; the sender's watch of the receiver's control plane fails the transfer instead."""
    child = Child(_receiver_child, "tiny")
    _, address, _ = child.recv()
    a = LLMEngine(tiny, _config("tiny"))
    baseline = free_blocks(a)
    prompt = random_prompts(1, [90], vocab=1000, seed=6)[0]
    sender = open_kv_sender("torch", address, a, "frozen", prompt, deadline_s=120.0)
    send = layer_sender(a, sender, prompt)

    def freeze_after_the_first_layer(layer: int) -> None:
        send(layer)
        if layer == 0:
            time.sleep(0.5)  # the first layer is through (and the pair group exists)
            os.kill(child.proc.pid, signal.SIGSTOP)

    try:
        prefill_layerwise(a, sender, prompt, FIRST, layers=freeze_after_the_first_layer)
        assert sender.wait(60) is TransferState.FAILED, "the sender waited for its 120 s deadline"
        assert sender.error is not None and sender.error.retryable and "unreachable" in sender.error.reason
        assert free_blocks(a) == baseline
    finally:
        os.kill(child.proc.pid, signal.SIGCONT)
        child.kill()
