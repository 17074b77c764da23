"""KV transfer on the tiny model: every transport's round trip, layer-wise sending, only-missing-blocks, faults.

The endpoints run in this process but grpc and torch still go through real sockets (gRPC, TCPStore, gloo).
Separate-process round trips with SmolLM2 are in test_kv_transfer_processes.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from kv_transfer import ReceiverEndpoint, TransferConfig, TransferError, TransferState, payload
from kv_transfer.transports.grpc_transport import GrpcKVSender
from kv_transfer.transports.nixl_transport import NixlKVSender
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

TRANSPORTS = ["grpc", "torch", "local", "nixl"]
N = 8
FIRST = SamplingParams(max_tokens=1, temperature=0)
PROMPT = random_prompts(1, [90], vocab=1000, seed=5)[0]  # 5 full blocks + 10 tokens


def engine(tiny, **overrides: object) -> LLMEngine:
    return LLMEngine(tiny, EngineConfig(num_blocks=64, num_threads=1, **overrides))  # type: ignore[arg-type]


@pytest.fixture
def endpoints(tiny):
    """One receiving engine per transport, each behind its own endpoint."""
    made: dict[str, ReceiverEndpoint] = {}

    def make(transport: str, **config: object) -> ReceiverEndpoint:
        ep = ReceiverEndpoint(engine(tiny), TransferConfig(transport=transport, **config),  # type: ignore[arg-type]
                              local_name=f"{transport}-{len(made)}")
        made[f"{transport}-{len(made)}"] = ep
        return ep

    yield make
    for ep in made.values():
        ep.close()


def decode_on(ep: ReceiverEndpoint, request_id: str, max_tokens: int = N) -> list[int]:
    assert ep.receiver.wait(request_id, 10) is TransferState.DONE, ep.receiver.error(request_id)
    ep.receiver.take(request_id, greedy(max_tokens))
    with ep.receiver.engine_lock:
        return run_to_completion(ep.receiver.engine)[request_id].token_ids


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_layerwise_round_trip_continues_like_one_engine(tiny, endpoints, transport):
    want = run_alone(tiny, PROMPT, greedy(N))
    a, ep = engine(tiny), endpoints(transport)
    a_free, b_free = free_blocks(a), free_blocks(ep.receiver.engine)
    sender = open_kv_sender(transport, ep.address, a, "r", PROMPT)
    first = prefill_layerwise(a, sender, PROMPT, FIRST)
    assert sender.wait(10) is TransferState.DONE, sender.error
    assert sender.cached_blocks == 0 and sender.num_blocks == 6
    assert sender.bytes_sent == a.kv_layout.num_layers * a.kv_layout.layer_nbytes(6)
    assert free_blocks(a) == a_free  # released after the first token, as the prefill worker does
    tokens = decode_on(ep, "r")
    assert first == want[:1] and tokens == want
    assert free_blocks(ep.receiver.engine) == b_free and ep.receiver.num_inflight == 0


def test_layers_are_handed_over_in_order_during_the_prefill_step(tiny):
    a = engine(tiny)
    seen: list[tuple[int, bool]] = []
    a.add_request("r", PROMPT, FIRST)
    a.watch_layers("r", lambda layer: seen.append((layer, a.has_unfinished_requests())))
    a.step()
    assert [layer for layer, _ in seen] == list(range(tiny.config.num_layers))
    assert all(running for _, running in seen)  # each layer arrives before the step (and the prefill) ends


@pytest.mark.parametrize("transport", ["grpc", "local", "nixl"])
def test_only_missing_blocks_move_when_the_receiver_caches_the_prefix(tiny, endpoints, transport):
    shared = random_prompts(1, [64], vocab=1000, seed=9)[0]  # 4 full blocks
    p1, p2 = shared + PROMPT[:20], shared + PROMPT[20:50]
    ep = endpoints(transport)
    b = ep.receiver.engine
    for rid, prompt in (("one", p1), ("two", p2)):
        a = engine(tiny)
        sender = open_kv_sender(transport, ep.address, a, rid, prompt)
        first = prefill_layerwise(a, sender, prompt, FIRST)
        assert sender.wait(10) is TransferState.DONE, sender.error
        want = run_alone(tiny, prompt, greedy(N))
        assert first + decode_on(ep, rid)[1:] == want
    layout = b.kv_layout
    assert sender.cached_blocks == 4 and sender.num_blocks == 2  # 94 tokens: 6 blocks, 4 linked
    assert sender.bytes_sent == layout.num_layers * layout.layer_nbytes(2)
    assert_idle(b)


class CorruptOnce(GrpcKVSender):
    """Flips one data byte of the first chunk of the first transfer it makes (after the chunk was sealed)."""

    corrupted = 0

    def _encode(self, chunk, data):  # type: ignore[no-untyped-def]
        msg = super()._encode(chunk, data)
        if CorruptOnce.corrupted == 0:
            CorruptOnce.corrupted += 1
            flipped = bytearray(msg)
            flipped[-7] ^= 0xFF  # NOTE: KVChunk.data is the message's last field
            return bytes(flipped)
        return msg


@pytest.mark.parametrize("retries", [0, 1])
def test_a_corrupted_chunk_fails_the_transfer_and_is_retried_once_if_asked(tiny, endpoints, retries):
    CorruptOnce.corrupted = 0
    a, ep = engine(tiny), endpoints("grpc")
    b = ep.receiver.engine
    baseline = free_blocks(b)
    for _ in range(retries + 1):  # a retry is a new prefill and transfer of the same request
        sender = open_kv_sender("grpc", ep.address, a, "r", PROMPT, sender_cls=CorruptOnce)
        first = prefill_layerwise(a, sender, PROMPT, FIRST)
        if sender.wait(10) is TransferState.DONE or not sender.error.retryable:
            break
    assert CorruptOnce.corrupted == 1
    if retries == 0:
        assert sender.state is TransferState.FAILED
        assert "checksum mismatch in layer 0" in sender.error.reason and sender.error.retryable
        assert ep.receiver.poll("r") is TransferState.FAILED
        assert wait_for(lambda: free_blocks(b) == baseline)
    else:
        assert sender.state is TransferState.DONE, sender.error
        assert first + decode_on(ep, "r")[1:] == run_alone(tiny, PROMPT, greedy(N))
        assert free_blocks(b) == baseline
    assert_idle(a)


class CorruptCheck(NixlKVSender):
    """Sends layer 0's K check one bit off: to the receiver, as if those blocks had changed on the way."""

    def _checks(self, layer, slot=None):  # type: ignore[no-untyped-def]
        k, v = super()._checks(layer, slot)
        return (str(int(k) ^ 1), v) if layer.index == 0 else (k, v)


def test_a_nixl_layer_unlike_its_check_fails_the_transfer_as_retryable_and_frees_it(tiny, endpoints):
    a, ep = engine(tiny), endpoints("nixl")
    b = ep.receiver.engine
    baseline = free_blocks(b)
    sender = open_kv_sender("nixl", ep.address, a, "r", PROMPT, sender_cls=CorruptCheck)
    prefill_layerwise(a, sender, PROMPT, FIRST)
    assert sender.wait(10) is TransferState.FAILED and sender.error.retryable, sender.error
    assert "checksum mismatch in layer 0 K (nixl)" in sender.error.reason
    assert ep.receiver.poll("r") is TransferState.FAILED
    assert wait_for(lambda: free_blocks(b) == baseline)  # NOTE: every layer's notification came: the fence lifts
    assert_idle(a)


@pytest.mark.parametrize("field", ["transfer_id", "layer", "kv", "first_block"])
def test_a_chunk_whose_description_changed_on_the_way_fails_the_checksum(tiny, endpoints, field):
    """The CRC32C covers the chunk's place as well as its bytes: intact data aimed at other blocks is refused."""
    ep = endpoints("local")
    b = ep.receiver.engine
    baseline = free_blocks(b)
    sender = open_kv_sender("local", ep.address, engine(tiny), "r", PROMPT)
    sender.prepare()
    k = torch.ones(2, *b.kv_layout.block_shape)
    if field == "transfer_id":  # sealed for another transfer, delivered to this one
        chunk = dataclasses.replace(payload.seal("another", 0, 0, 0, k), transfer_id=sender.transfer_id)
    else:
        chunk = dataclasses.replace(payload.seal(sender.transfer_id, 0, 0, 0, k), **{field: 1})
    with pytest.raises(TransferError, match="checksum mismatch") as err:
        ep.receiver.on_tensor(chunk, k)
    assert err.value.retryable and ep.receiver.poll("r") is TransferState.FAILED
    assert wait_for(lambda: free_blocks(b) == baseline)


LAYOUT_FIELDS = {"scope": "another-model|float32", "dtype": "bfloat16", "block_size": 32, "num_layers": 3,
                 "num_kv_heads": 1, "head_dim": 8}


@pytest.mark.parametrize("field", list(LAYOUT_FIELDS))
@pytest.mark.parametrize("transport", ["grpc", "local"])
def test_a_mismatched_layout_is_rejected_before_any_write(tiny, endpoints, transport, field):
    a, ep = engine(tiny), endpoints(transport)
    before = ep.receiver.engine.stats()
    sender = open_kv_sender(transport, ep.address, a, "r", PROMPT)
    sender.layout = dataclasses.replace(a.kv_layout, **{field: LAYOUT_FIELDS[field]})
    with pytest.raises(TransferError) as err:
        sender.prepare()
    assert f"{field}: sender has" in err.value.reason and not err.value.retryable
    assert sender.state is TransferState.FAILED
    assert ep.receiver.engine.stats() == before and ep.receiver.num_inflight == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sender_abort_frees_the_receivers_reservation(tiny, endpoints, transport):
    a, ep = engine(tiny), endpoints(transport)
    baseline = free_blocks(ep.receiver.engine)
    sender = open_kv_sender(transport, ep.address, a, "r", PROMPT)
    sender.prepare()
    assert free_blocks(ep.receiver.engine) == baseline - 6  # reserved
    sender.abort("client went away")
    assert sender.state is TransferState.FAILED
    assert wait_for(lambda: free_blocks(ep.receiver.engine) == baseline)
    assert "client went away" in ep.receiver.error("r").reason


# NOTE: a sender that dies after the handshake loses its reservation at the deadline: test_kv_transfer_queued.py
# (a live one keeps it with keep-alives while its prompt waits for prefill)


@pytest.mark.parametrize("transport", ["grpc", "nixl"])  # torch: a killed receiver, test_kv_transfer_processes.py
def test_receiver_gone_fails_the_sender_fast_and_the_prefill_side_is_idle(tiny, endpoints, transport):
    a, ep = engine(tiny), endpoints(transport)
    finished = threading.Event()
    sender = open_kv_sender(transport, ep.address, a, "r", PROMPT)
    sender.on_finish = lambda s: finished.set()
    sender.prepare()
    ep.close()  # the receiver goes away: server stopped, reservations dropped
    start = time.monotonic()
    prefill_layerwise(a, sender, PROMPT, FIRST, prepare=False)
    assert sender.wait(10) is TransferState.FAILED
    assert time.monotonic() - start < 5  # well inside the 30 s deadline
    assert finished.wait(1)
    assert_idle(a)


def test_a_receiver_that_took_the_port_of_a_gone_one_gets_the_next_transfer(tiny, endpoints):
    """The channel cached for the old receiver's address waits out its reconnect backoff (and would fail calls
    fast meanwhile): a handshake that never connected is tried once more on a fresh channel, not failed."""
    a, gone = engine(tiny), endpoints("grpc")
    sender = open_kv_sender("grpc", gone.address, a, "old", PROMPT)
    sender.prepare()
    gone.close()
    with pytest.raises(TransferError, match="UNAVAILABLE"):  # NOTE: puts the cached channel into its backoff
        sender.control.keep_alive("old", 2)
    sender.abort("the receiver went away")
    port = int(gone.address.rsplit(":", 1)[1])
    ep = ReceiverEndpoint(engine(tiny), TransferConfig(transport="grpc"), port=port)  # a restarted worker
    try:
        sender = open_kv_sender("grpc", ep.address, a, "new", PROMPT)
        first = prefill_layerwise(a, sender, PROMPT, FIRST)
        assert sender.wait(10) is TransferState.DONE, sender.error
        assert first + decode_on(ep, "new")[1:] == run_alone(tiny, PROMPT, greedy(N))
    finally:
        ep.close()


def test_receiver_abort_fails_the_sender(tiny, endpoints):
    a, ep = engine(tiny), endpoints("grpc")
    sender = open_kv_sender("grpc", ep.address, a, "r", PROMPT)
    sender.prepare()
    ep.receiver.abort_request("r", "decode worker draining")
    prefill_layerwise(a, sender, PROMPT, FIRST, prepare=False)
    assert sender.wait(10) is TransferState.FAILED
    assert "decode worker draining" in sender.error.reason
    assert_idle(a)
    assert_idle(ep.receiver.engine)


def test_commit_before_all_layers_arrived_fails(tiny, endpoints):
    a, ep = engine(tiny), endpoints("local")
    sender = open_kv_sender("local", ep.address, a, "r", PROMPT)
    send = layer_sender(a, sender, PROMPT)
    prefill_layerwise(a, sender, PROMPT, FIRST, layers=lambda layer: layer == 0 and send(layer))  # layer 0 only
    assert sender.wait(10) is TransferState.FAILED
    assert "before all data arrived" in sender.error.reason and "first: layer 1 K block 0" in sender.error.reason
    assert_idle(ep.receiver.engine)


def test_an_unclaimed_transfer_is_freed_at_its_deadline(tiny, endpoints):
    a, ep = engine(tiny), endpoints("local")
    baseline = free_blocks(ep.receiver.engine)
    sender = open_kv_sender("local", ep.address, a, "r", PROMPT, deadline_s=0.5)
    prefill_layerwise(a, sender, PROMPT, FIRST)
    assert sender.wait(5) is TransferState.DONE
    assert ep.receiver.poll("r") is TransferState.DONE  # ... and the decode worker never takes it
    assert wait_for(lambda: free_blocks(ep.receiver.engine) == baseline, timeout=3)
    with pytest.raises(TransferError):
        ep.receiver.take("r", greedy(N))


def test_transfer_config_names_the_bad_field():
    for kwargs, field in (({"transport": "rdma"}, "transport"), ({"chunk_bytes": 10}, "chunk_bytes"),
                          ({"torch_backend": "nccl"}, "torch_device"),
                          ({"torch_backend": "gloo", "torch_device": "cuda"}, "torch_device"),
                          ({"grpc_streams": 0}, "grpc_streams")):
        with pytest.raises(ValueError, match=f"^{field}:"):
            TransferConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("sent", ["", "wrong-token"], ids=["no-token", "wrong-token"])
def test_a_kv_endpoint_accepts_only_cluster_members(tiny, sent):
    """A receiver started with a cluster token refuses callers without it before reserving anything."""
    decode = engine(tiny)
    ep = ReceiverEndpoint(decode, TransferConfig(transport="grpc", cluster_token="s3cret-token"))
    try:
        prefill = engine(tiny)
        before = decode.stats()
        outsider = open_kv_sender("grpc", ep.address, prefill, "auth", PROMPT, cluster_token=sent)
        with pytest.raises(TransferError, match="UNAUTHENTICATED") as e:
            outsider.prepare()
        assert not e.value.retryable and "s3cret" not in str(e.value)
        assert decode.stats() == before
        member = open_kv_sender("grpc", ep.address, prefill, "auth", PROMPT, cluster_token="s3cret-token")
        prefill_layerwise(prefill, member, PROMPT, FIRST)
        assert member.wait(10) is TransferState.DONE
    finally:
        ep.close()
