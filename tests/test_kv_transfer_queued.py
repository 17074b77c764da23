"""KV transfers under load (issue 19 items 4, 5, 6): prompts queued for prefill, many transfers to one receiver,
aborts on a shared torch pair. Real sockets: gRPC, TCPStore and gloo, the endpoints in this process.

The cluster-level check of item 4 (a saturated cluster prefills each prompt once) is in test_kv_saturated.py.
"""

from __future__ import annotations

import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from kv_transfer import ReceiverEndpoint, TransferConfig, TransferState
from kv_transfer.messages import PrepareRequest
from tests.helpers import (
    assert_idle,
    free_blocks,
    greedy,
    layer_sender,
    open_kv_sender,
    prefill_layerwise,
    random_prompts,
    run_alone,
    run_to_completion,
    wait_for,
)

N = 6
FIRST = SamplingParams(max_tokens=1, temperature=0)
PROMPTS = random_prompts(12, [90], vocab=1000, seed=19)  # 6 blocks each, no shared prefix


def engine(tiny, num_blocks: int = 64) -> LLMEngine:
    return LLMEngine(tiny, EngineConfig(num_blocks=num_blocks, num_threads=1))


@pytest.fixture
def receiver(tiny):
    made: list[ReceiverEndpoint] = []

    def make(transport: str, num_blocks: int = 64) -> ReceiverEndpoint:
        ep = ReceiverEndpoint(engine(tiny, num_blocks), TransferConfig(transport=transport),  # type: ignore[arg-type]
                              local_name=f"queued-{transport}-{len(made)}")
        made.append(ep)
        return ep

    yield make
    for ep in made:
        ep.close()


def decode_on(ep: ReceiverEndpoint, request_id: str) -> list[int]:
    assert ep.receiver.wait(request_id, 10) is TransferState.DONE, ep.receiver.error(request_id)
    ep.receiver.take(request_id, greedy(N))
    with ep.receiver.engine_lock:
        return run_to_completion(ep.receiver.engine)[request_id].token_ids


# ---- item 4: the deadline runs from the first layer, keep-alives hold a queued transfer ---------------------------
@pytest.mark.parametrize("transport", ["grpc", "torch", "local"])
def test_a_transfer_queued_past_its_deadline_completes_while_its_sender_lives(tiny, receiver, transport):
    """The prompt waits for prefill 4x longer than the deadline after the handshake: the transfer still lands."""
    a, ep = engine(tiny), receiver(transport)
    prompt = PROMPTS[0]
    sender = open_kv_sender(transport, ep.address, a, "queued", prompt, deadline_s=0.5)
    sender.prepare()
    time.sleep(2.0)  # NOTE: the prefill queue: keep-alives (every deadline/3) hold the reservation
    assert ep.receiver.poll("queued") is TransferState.TRANSFERRING and sender.state is TransferState.TRANSFERRING
    first = prefill_layerwise(a, sender, prompt, FIRST, prepare=False)
    assert sender.wait(10) is TransferState.DONE, sender.error
    assert first + decode_on(ep, "queued")[1:] == run_alone(tiny, prompt, greedy(N))
    assert_idle(ep.receiver.engine)


@pytest.mark.parametrize("transport", ["grpc", "torch"])
def test_a_dead_sender_loses_its_reservation_at_the_deadline(tiny, receiver, transport):
    """A sender that dies right after the handshake sends no keep-alive: the receiver frees its blocks."""
    a, ep = engine(tiny), receiver(transport)
    baseline = free_blocks(ep.receiver.engine)
    sender = open_kv_sender(transport, ep.address, a, "dead", PROMPTS[1], deadline_s=0.5)
    # NOTE: the handshake over the sender's own control channel, but no sender thread behind it
    sender.control.prepare(PrepareRequest("dead", a.kv_layout, PROMPTS[1], len(PROMPTS[1]),
                                          [bytes(h) for h in sender.block_hashes], transport, 500, "dead-sender"), 5)
    assert free_blocks(ep.receiver.engine) == baseline - 6
    assert wait_for(lambda: free_blocks(ep.receiver.engine) == baseline, timeout=3)
    assert "deadline" in ep.receiver.error("dead").reason


# ---- item 5: idle transfers hold no receiver thread ----------------------------------------------------------------
def test_more_queued_transfers_to_one_receiver_than_its_threads_all_complete(tiny, receiver):
    """16 server threads, 2 Push streams per transfer: 12 transfers queued at once, sent last-prepared first."""
    a, ep = engine(tiny, 256), receiver("grpc", num_blocks=256)
    senders = []
    for i, prompt in enumerate(PROMPTS):  # NOTE: each handshake needs a server thread too
        senders.append(open_kv_sender("grpc", ep.address, a, f"q{i}", prompt, deadline_s=3.0))
        senders[-1].prepare()
    time.sleep(0.5)
    for i in reversed(range(len(PROMPTS))):  # the last queued is prefilled first
        first = prefill_layerwise(a, senders[i], PROMPTS[i], FIRST, prepare=False)
        assert senders[i].wait(10) is TransferState.DONE, senders[i].error
        assert first + decode_on(ep, f"q{i}")[1:] == run_alone(tiny, PROMPTS[i], greedy(N))


# ---- item 6: an abort on a torch pair fails that transfer only ----------------------------------------------------
def stop_after(a: LLMEngine, sender, prompt: list[int], layers: int) -> None:  # type: ignore[no-untyped-def]
    """A prefill that hands over only the first `layers` layers and ends without a commit (then the abort)."""
    send = layer_sender(a, sender, prompt)

    def some(layer: int) -> None:
        if layer < layers:
            send(layer)

    a.add_request(sender.request_id, prompt, FIRST)
    a.watch_layers(sender.request_id, some)
    next(o for _ in range(100) for o in a.step() if o.request_id == sender.request_id)
    a.abort_request(sender.request_id)


@pytest.mark.parametrize("when", ["queued", "mid_transfer", "after_first_token"])
def test_an_aborted_torch_transfer_leaves_the_others_on_its_pair_intact(tiny, receiver, when):
    """Three transfers queued on one prefill/decode pair; the middle one is aborted; the other two land intact.

    `after_first_token` is a request that ends at its first token (max_tokens 1, EOS): every layer was sent, the
    prefill worker aborts instead of committing.
    """
    a, ep = engine(tiny), receiver("torch")
    b, num_layers = ep.receiver.engine, tiny.config.num_layers
    baseline = free_blocks(b)
    senders = [open_kv_sender("torch", ep.address, a, f"p{i}", PROMPTS[i]) for i in range(3)]
    for s in senders:  # NOTE: one sender id: every transfer rides the same pair group, in handshake order
        s.prepare()
    prefill_layerwise(a, senders[0], PROMPTS[0], FIRST, prepare=False)
    if when == "queued":
        senders[1].abort("client went away")
    else:
        stop_after(a, senders[1], PROMPTS[1], num_layers // 2 if when == "mid_transfer" else num_layers)
        senders[1].abort("the request finished at its first token")
    first = prefill_layerwise(a, senders[2], PROMPTS[2], FIRST, prepare=False)
    assert senders[0].wait(10) is TransferState.DONE, senders[0].error
    assert senders[1].wait(10) is TransferState.FAILED
    assert senders[2].wait(10) is TransferState.DONE, senders[2].error
    assert ep.receiver.poll("p1") is TransferState.FAILED
    assert first + decode_on(ep, "p2")[1:] == run_alone(tiny, PROMPTS[2], greedy(N))
    decode_on(ep, "p0")
    assert wait_for(lambda: free_blocks(b) == baseline)
    # ... and the pair goes on serving: one more transfer on it
    late = open_kv_sender("torch", ep.address, a, "late", PROMPTS[3])
    first = prefill_layerwise(a, late, PROMPTS[3], FIRST)
    assert late.wait(10) is TransferState.DONE, late.error
    assert first + decode_on(ep, "late")[1:] == run_alone(tiny, PROMPTS[3], greedy(N))
