"""nixl: a posted write cannot be recalled, so a failed transfer's blocks stay reserved until no write can land.

1. A sender frozen (SIGSTOP) mid-transfer with its Watch open: the receiver's deadline (or an abort on the decode
   side, the router's) fails the transfer but keeps its blocks; meanwhile other requests run on the rest of the
   pool; resumed, the sender writes its next layer into the kept blocks and says it is done: they are freed, and no
   other block of the pool changed.
2. A frozen receiver: the sender's deadline frees everything on its side at once, the receiver's when it thaws.
3. A handshake the receiver answers after its sender gave up (the decode engine hung past the sender's deadline):
   the sender never learned the block ids, so they are freed at once, whether the sender's abort of the handshake
   reaches the receiver first or is lost; the pair goes on.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import traceback

import pytest
import torch

from engine import LLMEngine
from engine.loader import load_model
from kv_transfer import ReceiverEndpoint, TransferConfig, TransferError, TransferState
from kv_transfer.messages import Abort
from kv_transfer.transports.nixl_transport import NixlKVSender
from tests.helpers import (
    describe,
    free_blocks,
    greedy,
    open_kv_sender,
    prefill_layerwise,
    random_prompts,
    run_to_completion,
    wait_for,
)
from tests.test_kv_transfer_processes import Child, _config, _receiver_child


def _frozen_sender_child(conn, address: str, prompt: list[int], deadline_s: float) -> None:  # type: ignore[no-untyped-def]
    """Prefill `prompt`, write its layer 0 to `address`, then wait for "go" (the test freezes it meanwhile)."""
    try:
        a = LLMEngine(load_model("tiny"), _config("tiny"))
        a.add_request("frozen", prompt, greedy(2))  # NOTE: two tokens: the request keeps its blocks after the first
        while not any(o.request_id == "frozen" for o in a.step()):
            pass
        sender = open_kv_sender("nixl", address, a, "frozen", prompt, deadline_s=deadline_s)
        sender.prepare()
        ids = a.kv_block_ids("frozen", sender.cached_blocks, len(prompt))
        sender.send_blocks(0, ids)
        time.sleep(0.3)  # layer 0 posted and written
        conn.send(("sent", ids))
        conn.recv()  # "go", after the test froze and thawed this process
        for layer in range(1, a.kv_layout.num_layers):
            sender.send_blocks(layer, ids)  # NOTE: into blocks the receiver failed at its deadline
        sender.commit([1])
        state = sender.wait(10)
        conn.send(("done", state.value, sender.error.reason if sender.error else "", free_blocks(a)))
        conn.recv()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _others(pool: torch.Tensor, kept: list[int]) -> torch.Tensor:
    """Every block of the pool but `kept` ([layers, 2, blocks, ...] → a copy)."""
    mask = torch.ones(pool.shape[2], dtype=torch.bool)
    mask[kept] = False
    return pool[:, :, mask].clone()


@pytest.mark.parametrize("failure", ["deadline", "abort"])
def test_a_frozen_sender_keeps_its_blocks_fenced_and_no_other_block_changes(tiny, failure):
    b = LLMEngine(tiny, _config("tiny"))
    ep = ReceiverEndpoint(b, TransferConfig(transport="nixl"))
    child = None
    try:
        baseline = free_blocks(b)
        prompt = random_prompts(1, [90], vocab=1000, seed=31)[0]
        child = Child(_frozen_sender_child, ep.address, prompt, 1.0 if failure == "deadline" else 60.0)
        child.recv()
        os.kill(child.proc.pid, signal.SIGSTOP)
        if failure == "abort":  # NOTE: the router aborts the request while the sender's writes may be in flight
            ep.receiver.abort_request("frozen", "aborted by the router")
        assert ep.receiver.wait("frozen", 10) is TransferState.FAILED  # its 1 s deadline passed, or the abort
        kept = list(ep.receiver._by_request["frozen"].res.fresh_blocks)
        assert free_blocks(b) == baseline - len(kept), "the failed transfer's blocks must stay reserved"
        # other requests use the rest of the pool while the sender is frozen (its writes could be in flight)
        others = random_prompts(3, [70, 40, 100], vocab=1000, seed=32)
        for i, p in enumerate(others):
            b.add_request(f"other-{i}", p, greedy(6))
        run_to_completion(b)
        assert b.stats().num_reserved == 1 and ep.receiver.poll("frozen") is TransferState.FAILED, \
            "the failed transfer's blocks were freed while its sender may still write"
        before = _others(b.runner.kv, kept)
        os.kill(child.proc.pid, signal.SIGCONT)
        child.conn.send("go")
        _, state, reason, sender_free = child.recv(30)
        assert state == "failed" and ("deadline" in reason if failure == "deadline" else "aborted" in reason)
        deadline = time.monotonic() + 10
        while free_blocks(b) != baseline and time.monotonic() < deadline:
            time.sleep(0.05)
        assert free_blocks(b) == baseline and ep.receiver.num_inflight == 0 and b.stats().num_reserved == 0
        assert torch.equal(_others(b.runner.kv, kept), before), "a late write landed outside the fenced blocks"
        child.conn.send("stop")
    finally:
        if child is not None:
            os.kill(child.proc.pid, signal.SIGCONT)
            child.kill()
        ep.close()


def test_a_frozen_receiver_is_freed_by_the_deadline_on_both_sides(tiny):
    child = Child(_receiver_child, "tiny", "nixl")
    _, address, receiver_baseline = child.recv()
    a = LLMEngine(tiny, _config("tiny"))
    baseline = free_blocks(a)
    prompt = random_prompts(1, [90], vocab=1000, seed=33)[0]
    try:
        sender = open_kv_sender("nixl", address, a, "cold", prompt, deadline_s=1.5)
        sender.prepare()
        os.kill(child.proc.pid, signal.SIGSTOP)
        a.add_request("cold", prompt, greedy(2))  # NOTE: two tokens: it keeps its blocks after the first
        while not any(o.request_id == "cold" for o in a.step()):
            pass  # NOTE: run by hand (not prefill_layerwise): the request must hold its blocks while we send
        ids = a.kv_block_ids("cold", sender.cached_blocks, len(prompt))
        for layer in range(a.kv_layout.num_layers):
            sender.send_blocks(layer, ids)
        sender.commit([1])
        a.abort_request("cold")
        assert sender.wait(30) is TransferState.FAILED and sender.error is not None
        assert free_blocks(a) == baseline, "the sender's pinned blocks must be released"
        os.kill(child.proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            _, stats, inflight = child.ask("stats")
            if stats.num_free_blocks == receiver_baseline.num_free_blocks and inflight == 0:
                break
            time.sleep(0.1)
        assert stats.num_free_blocks == receiver_baseline.num_free_blocks and stats.num_reserved == 0
        assert inflight == 0
    finally:
        os.kill(child.proc.pid, signal.SIGCONT)
        child.kill()


class _AbortLost(NixlKVSender):
    """A nixl sender whose abort of a failed handshake never reaches the receiver."""

    def _prepare_failed(self, req, err):  # type: ignore[no-untyped-def]
        return None


@pytest.mark.parametrize("abort", ["reaches the receiver first", "is lost"])
def test_a_handshake_answered_after_its_sender_gave_up_frees_its_blocks(tiny, abort):
    b, a = LLMEngine(tiny, _config("tiny")), LLMEngine(tiny, _config("tiny"))
    ep = ReceiverEndpoint(b, TransferConfig(transport="nixl"))
    try:
        baseline = free_blocks(b)
        late, fresh = random_prompts(2, [90, 70], vocab=1000, seed=34)
        with ep.receiver.engine_lock:  # NOTE: the decode engine hangs (its loop holds this lock, as debug_hang does)
            sender = open_kv_sender("nixl", ep.address, a, "late", late, deadline_s=0.5,
                                    sender_cls=None if abort.startswith("reaches") else _AbortLost)
            with pytest.raises(TransferError, match="DEADLINE_EXCEEDED"):
                sender.prepare()
            if abort.startswith("reaches"):
                assert wait_for(lambda: bool(ep.receiver._abandoned), 10), \
                    "the sender's abort of its handshake did not arrive"
        # the hang ended: the late handshake reserves blocks and answers a call that ended long ago
        assert wait_for(lambda: "late" in ep.receiver._by_request, 10)
        assert ep.receiver.wait("late", 10) is TransferState.FAILED
        assert wait_for(lambda: free_blocks(b) == baseline, 10), "blocks nobody will ever write stay reserved"
        assert b.stats().num_reserved == 0 and ep.receiver.num_inflight == 0
        # the pair goes on: the next transfer over the same Watch completes
        sender = open_kv_sender("nixl", ep.address, a, "fresh", fresh)
        prefill_layerwise(a, sender, fresh)
        assert sender.wait(10) is TransferState.DONE and ep.receiver.wait("fresh", 10) is TransferState.DONE
    finally:
        ep.close()


def test_an_abort_naming_a_handshake_frees_it_fenced_or_refuses_it_before_it_comes(tiny):
    b = LLMEngine(tiny, _config("tiny"))
    ep = ReceiverEndpoint(b, TransferConfig(transport="nixl"))
    try:
        ep.side.watch("sender-agent")  # NOTE: the sender's Watch is open (the plain call its gRPC handler makes)
        baseline = free_blocks(b)
        first, second = random_prompts(2, [90, 70], vocab=1000, seed=35)
        req = dataclasses.replace(describe(b, "answered", first), transport="nixl", nixl_agent="sender-agent",
                                  attempt_id="attempt-1")
        prepared = ep.receiver.prepare(req)  # answered, fenced; the answer never reached the sender
        assert prepared.nixl is not None and free_blocks(b) < baseline
        ep.receiver.abort(Abort("", "prepare timed out", quiesced=True, attempt_id="attempt-1"))
        assert ep.receiver.poll("answered") is TransferState.FAILED and free_blocks(b) == baseline
        # the abort overtakes its handshake: the handshake is refused and reserves nothing
        ep.receiver.abort(Abort("", "prepare timed out", quiesced=True, attempt_id="attempt-2"))
        req = dataclasses.replace(describe(b, "overtaken", second), transport="nixl", nixl_agent="sender-agent",
                                  attempt_id="attempt-2")
        with pytest.raises(TransferError, match="aborted by the sender"):
            ep.receiver.prepare(req)
        assert free_blocks(b) == baseline and b.stats().num_reserved == 0 and ep.receiver.num_inflight == 0
    finally:
        ep.close()
