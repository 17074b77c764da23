"""The KV hand-off across TP sizes (engine/parallel/kv.py): a TP group exports and imports KV in the full model's
layout, so prefill on TP a and decode on TP b continue the tokens of one TP 1 engine (engine to engine through the
KV seam, no cluster; gloo, CPU, float32; the tiny random models of tests/test_tensor_parallel.py). NIXL writes
between the groups' pools themselves, whatever their TP sizes (kv_transfer/transports/nixl_reshard.py).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_hash import hash_prompt_blocks
from engine.errors import InvalidRequestError
from engine.kv_export import KVLayout
from engine.kv_import import KVReservation
from engine.kv_quant import dequantize_blocks
from engine.loader import LoadedModel, tiny_model
from engine.parallel.kv import read_sources
from engine.parallel.launch import TPGroupError
from engine.parallel.runner import TPModelRunner
from kv_transfer import KVSender, ReceiverEndpoint, TransferConfig, TransferError, TransferState
from kv_transfer.transports.nixl_transport import NixlKVSender
from kv_transfer.transports.nixl_writes import staging
from tests.helpers import (
    assert_idle,
    free_blocks,
    generate_ids,
    greedy,
    open_kv_sender,
    prefill_layerwise,
    random_prompts,
    run_to_completion,
    wait_for,
)
from tests.test_tensor_parallel import LAYOUTS, assert_same_or_near_tie

N_TOKENS = 32
Layers = list[tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module")
def models() -> dict[str, LoadedModel]:
    return {name: tiny_model(**LAYOUTS[name]) for name in ("gqa-8q-4kv", "tiny-4q-2kv")}


def engine(loaded: LoadedModel, tp: int, **overrides: object) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(num_blocks=64, max_num_batched_tokens=256, num_threads=1,
                                          tensor_parallel_size=tp, **overrides))  # type: ignore[arg-type]


def prefill(eng: LLMEngine, rid: str, prompt: list[int]) -> tuple[list[int], Layers]:
    """What a prefill worker does: the prompt's first token, and each layer's K and V read from inside the forward
    pass as soon as it is written (`watch_layers` → `read_kv_layer`)."""
    layers: Layers = []
    eng.add_request(rid, prompt, greedy(1))
    eng.watch_layers(rid, lambda layer: layers.append(eng.read_kv_layer(rid, layer, num_tokens=len(prompt))))
    first = next(o for _ in range(100) for o in eng.step() if o.request_id == rid).new_token_ids
    eng.abort_request(rid)  # NOTE: the prefill worker's release: decoding goes on elsewhere
    assert len(layers) == eng.model_config.num_layers
    return first, layers


def reserve(eng: LLMEngine, rid: str, prompt: list[int], layout: KVLayout) -> KVReservation:
    hashes = hash_prompt_blocks(prompt, eng.config.block_size, eng.scope)
    return eng.reserve_kv(rid, layout, prompt, len(prompt), hashes)


def write(eng: LLMEngine, res: KVReservation, layers: Layers, until: threading.Event | None = None) -> int:
    """What a decode worker's receiver does with the layers as they arrive (over and over until `until` is set: a
    longer write); how many times it wrote them."""
    rounds = 0
    while rounds == 0 or (until is not None and not until.is_set()):
        for i, (k, v) in enumerate(layers):
            eng.write_kv_blocks(res, i, 0, 0, k)
            eng.write_kv_blocks(res, i, 1, 0, v)
        rounds += 1
    return rounds


def import_kv(eng: LLMEngine, rid: str, prompt: list[int], first: list[int], layers: Layers, layout: KVLayout) -> None:
    """Reserve, write each layer's K and V, commit with the first token."""
    write(eng, reserve(eng, rid, prompt, layout), layers)
    eng.commit_kv(rid, first, greedy(N_TOKENS))


def decode(eng: LLMEngine, rid: str) -> list[int]:
    return run_to_completion(eng)[rid].token_ids


def hand_off(src: LLMEngine, ep: ReceiverEndpoint, sender: KVSender, prompt: list[int], replicas: int = 1) -> list[int]:
    """What the workers do with a 45-token prompt (2 full blocks + 13 tokens): prefill it on `src` handing each layer
    to `sender` from inside the forward, wait until `ep`'s receiver holds every block (all the model's KV heads,
    each in `replicas` of its ranks' pools), decode there; the tokens."""
    cfg = src.model_config
    prefill_layerwise(src, sender, prompt, greedy(1))
    assert sender.wait(30) is TransferState.DONE, sender.error
    full_block = src.kv_layout.layer_nbytes(1) * cfg.num_layers  # K and V, every layer (an int8 block's scales too)
    assert sender.bytes_sent == 3 * full_block * replicas
    ep.receiver.take(sender.request_id, greedy(N_TOKENS))
    return decode(ep.receiver.engine, sender.request_id)


@pytest.mark.parametrize("layout,src_tp,dst_tp", [("gqa-8q-4kv", 2, 1), ("gqa-8q-4kv", 1, 2), ("tiny-4q-2kv", 4, 2)],
                         ids=["tp2-to-tp1", "tp1-to-tp2", "tp4-kv-replicated-to-tp2"])
def test_prefill_on_one_tp_size_decodes_on_another_as_one_tp1_engine(models: dict[str, LoadedModel], layout: str,
                                                                     src_tp: int, dst_tp: int) -> None:
    loaded = models[layout]
    prompts = random_prompts(3, [37, 16, 50], vocab=loaded.config.vocab_size, seed=40 + src_tp + dst_tp)
    ref_engine = engine(loaded, 1)
    ref = generate_ids(ref_engine, prompts, greedy(N_TOKENS))
    src, dst = engine(loaded, src_tp), engine(loaded, dst_tp)
    try:
        assert src.kv_layout == dst.kv_layout == ref_engine.kv_layout  # NOTE: the peer sees the full model's heads
        moved = []
        for i, prompt in enumerate(prompts):
            first, layers = prefill(src, f"p{i}", prompt)
            _, ref_layers = prefill(ref_engine, f"ref{i}", prompt)
            for (k, v), (rk, rv) in zip(layers, ref_layers):  # every head, in model order, as TP 1 holds them
                assert k.shape == rk.shape and torch.allclose(k, rk, atol=1e-5) and torch.allclose(v, rv, atol=1e-5)
            import_kv(dst, f"p{i}", prompt, first, layers, src.kv_layout)
            moved.append(decode(dst, f"p{i}"))
    finally:
        src.close()
        dst.close()
    assert_same_or_near_tie(ref_engine, prompts, ref, moved)


@pytest.mark.parametrize("path", ["shared", "threads"])
def test_the_local_transport_carries_kv_from_a_group_to_a_group_unchanged(models: dict[str, LoadedModel], path: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """TP 2 → TP 2 through a transport as the workers run it (a sender fed from inside the forward, the receiver's
    endpoint writing): the transport sees one engine with all the model's KV heads on either side. Rank 0 reads and
    writes the follower's heads in its pool mapped from shared memory ("shared", the CPU's default), or through the
    follower's KV thread ("threads", as on CUDA)."""
    monkeypatch.setenv("PDCLUSTER_TP_KV", path)
    loaded = models["gqa-8q-4kv"]
    cfg = loaded.config
    prompt = random_prompts(1, [45], vocab=cfg.vocab_size, seed=21)[0]  # 2 full blocks + 13 tokens
    ref_engine = engine(loaded, 1)
    ref = generate_ids(ref_engine, [prompt], greedy(N_TOKENS))
    src = engine(loaded, 2)
    ep = ReceiverEndpoint(engine(loaded, 2), TransferConfig(transport="local"), local_name="tp-kv-local")
    try:
        for group in (src, ep.receiver.engine):
            pools = group.runner.kv_gather.pools
            assert (sorted(pools) == [1]) if path == "shared" else pools is None
        moved = hand_off(src, ep, open_kv_sender("local", ep.address, src, "x", prompt), prompt)
    finally:
        src.close()
        ep.close()
        ep.receiver.engine.close()
    assert_same_or_near_tie(ref_engine, [prompt], ref, [moved])


def test_a_group_takes_kv_from_a_receiver_thread_while_it_steps(models: dict[str, LoadedModel]) -> None:
    """Writes from another thread (the seam's receivers) while the group computes another request's steps, from
    inside whose forward a read of a third request's layers also runs."""
    loaded = models["gqa-8q-4kv"]
    a, b, c = random_prompts(3, [45, 30, 21], vocab=loaded.config.vocab_size, seed=9)
    ref_engine = engine(loaded, 1)
    ref = generate_ids(ref_engine, [a, b], greedy(N_TOKENS))
    first, layers = prefill(ref_engine, "moved", a)
    group = engine(loaded, 2)
    try:
        group.add_request("busy", b, greedy(N_TOKENS))
        group.step()
        res = reserve(group, "moved", a, group.kv_layout)
        until, rounds = threading.Event(), []
        writer = threading.Thread(target=lambda: rounds.append(write(group, res, layers, until)))
        writer.start()
        read: Layers = []
        group.add_request("read", c, greedy(1))
        group.watch_layers("read", lambda layer: read.append(group.read_kv_layer("read", layer)))
        out = {}
        for _ in range(4):  # NOTE: steps with requests ("busy" decodes 32 tokens) while the writer writes
            assert group.has_unfinished_requests()
            out |= {o.request_id: o for o in group.step() if o.finished}
        until.set()
        writer.join()
        group.commit_kv("moved", first, greedy(N_TOKENS))  # NOTE: a commit runs between steps (the engine lock)
        print(f"the writer wrote the layers {rounds[0]} times over 4 steps")
        assert len(read) == loaded.config.num_layers and rounds[0] > 1
        out |= run_to_completion(group)
    finally:
        group.close()
    assert_same_or_near_tie(ref_engine, [a, b], ref, [out["moved"].token_ids, out["busy"].token_ids])


def test_replicated_kv_heads_are_read_once() -> None:
    cfg = tiny_model(**LAYOUTS["tiny-4q-2kv"]).config  # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0
    assert read_sources(cfg, 4) == {0: range(0, 1), 2: range(1, 2)}
    assert read_sources(cfg, 2) == {0: range(0, 1), 1: range(1, 2)}


def test_int8_kv_blocks_move_with_their_scales(models: dict[str, LoadedModel]) -> None:
    """int8 KV: each head's scale sits in that head's part of the block's scale row, so it moves with its head."""
    loaded = models["gqa-8q-4kv"]
    prompt = random_prompts(1, [40], vocab=loaded.config.vocab_size, seed=12)[0]
    ref_engine, group = engine(loaded, 1, kv_cache_dtype="int8"), engine(loaded, 2, kv_cache_dtype="int8")
    try:
        _, ref_layers = prefill(ref_engine, "r", prompt)
        first, layers = prefill(group, "r", prompt)
        bs = group.config.block_size
        for (k, _), (rk, _) in zip(layers, ref_layers):
            assert k.dtype == torch.int8 and k.shape == rk.shape
            scale = float(dequantize_blocks(rk, bs, torch.float32).abs().max()) / 127
            assert torch.allclose(dequantize_blocks(k, bs, torch.float32), dequantize_blocks(rk, bs, torch.float32),
                                  atol=1.01 * scale)  # NOTE: one step of int8 rounding apart at most
        other = random_prompts(1, [40], vocab=loaded.config.vocab_size, seed=13)[0]  # NOTE: none of it cached
        res = reserve(group, "back", other, group.kv_layout)
        group.write_kv_blocks(res, 1, 0, 0, layers[0][0])  # the bytes round trip exactly, scales included
        assert torch.equal(group.runner.read_blocks(1, res.fresh_blocks)[0], layers[0][0])
        group.abort_request("back")
    finally:
        group.close()


def test_a_kv_read_or_write_after_a_rank_died_fails_the_group(models: dict[str, LoadedModel]) -> None:
    group = engine(models["gqa-8q-4kv"], 2)
    try:
        runner = group.runner
        assert isinstance(runner, TPModelRunner)
        k, _ = runner.read_blocks(0, [0, 1])
        pid = runner.followers.procs[0].process.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        runner.followers.procs[0].process.join(10)  # NOTE: it died (a shared pool's read would not notice the signal)
        start = time.monotonic()
        with pytest.raises(TPGroupError, match=rf"group of 2 failed: rank 1 \(pid {pid}\): killed by SIGKILL"):
            runner.read_blocks(0, [0, 1])
        assert time.monotonic() - start < 30  # NOTE: not the group's timeout: closed sockets fail at once
        with pytest.raises(TPGroupError, match="rank 1"):  # and every later use, at once
            runner.write_blocks(0, 0, [0, 1], k)
        with pytest.raises(TPGroupError, match="rank 1"):
            group.add_request("x", [101, 102, 103], SamplingParams(max_tokens=2))
            group.step()
    finally:
        group.close()


def test_nixl_is_refused_for_a_group_whose_pools_are_not_mapped_and_a_closed_group_reads_nothing(
        models: dict[str, LoadedModel], monkeypatch: pytest.MonkeyPatch) -> None:
    from kv_transfer.pool import KVPool

    monkeypatch.setenv("PDCLUSTER_TP_KV", "threads")  # NOTE: as on CUDA: the followers' pools are theirs alone
    group = engine(models["gqa-8q-4kv"], 2)
    try:
        with pytest.raises(InvalidRequestError, match="tensor_parallel_size: 2: the nixl transport reads") as e:
            _ = KVPool(group).kvs  # NOTE: rank 0's tensor holds its own KV heads only
        assert e.value.field == "tensor_parallel_size"
    finally:
        group.close()
    with pytest.raises(TPGroupError, match="closed"):  # NOTE: the followers' KV threads are gone: no wait
        group.runner.read_blocks(0, [0])


# layout, sender TP, receiver TP, receiver ranks whose blocks the sender gathers (the others: straight from one
# sender rank's pool holding exactly their KV heads)
NIXL_TP = {"tp2-to-tp2": ("gqa-8q-4kv", 2, 2, 0), "tp2-to-tp1": ("gqa-8q-4kv", 2, 1, 1),
           "tp1-to-tp2": ("gqa-8q-4kv", 1, 2, 2), "tp4-to-tp2": ("gqa-8q-4kv", 4, 2, 2),
           # 2 KV heads: at TP 4 each is replicated on 2 ranks
           "tp1-to-tp4-replicated": ("tiny-4q-2kv", 1, 4, 4), "tp4-replicated-to-tp1": ("tiny-4q-2kv", 4, 1, 1),
           "tp2-to-tp4-replicated": ("tiny-4q-2kv", 2, 4, 0),
           # int8 KV: each head's scale sits in its own column of the block's scale row, so it is gathered with it
           "tp2-to-tp1-int8": ("gqa-8q-4kv", 2, 1, 1)}


@pytest.mark.parametrize("case", list(NIXL_TP))
def test_nixl_carries_kv_between_groups_of_any_tp_sizes(models: dict[str, LoadedModel], case: str) -> None:
    """NIXL between TP groups (CPU): the sender's rank 0 maps every rank's pool, the receiver's too; a receiver rank
    holding exactly one sender rank's KV heads gets its blocks straight from that rank's pool, any other has its
    blocks gathered from the sender ranks holding its heads into a staging slot, then written (nixl_reshard.py);
    one WRITE per layer, one check per receiver rank. The decode continues one TP 1 engine's tokens, and the bytes
    crossed NIXL: every receiver rank's blocks (replicas included), from a sender reading the pool."""
    layout, src_tp, dst_tp, gathered = NIXL_TP[case]
    kv = {"kv_cache_dtype": "int8"} if case.endswith("int8") else {}
    loaded = models[layout]
    cfg = loaded.config
    prompt = random_prompts(1, [45], vocab=cfg.vocab_size, seed=23 + src_tp + 5 * dst_tp)[0]  # 2 blocks + 13 tokens
    ref_engine = engine(loaded, 1, **kv)
    ref = generate_ids(ref_engine, [prompt], greedy(N_TOKENS))
    src = engine(loaded, src_tp, **kv)
    ep = ReceiverEndpoint(engine(loaded, dst_tp, **kv), TransferConfig(transport="nixl"), local_name="tp-kv-nixl")
    try:
        sender = open_kv_sender("nixl", ep.address, src, "x", prompt)
        assert isinstance(sender, NixlKVSender) and sender.reads_pool and len(sender.pool.kvs) == src_tp
        replicas = max(1, dst_tp // cfg.num_kv_heads)  # NOTE: each KV head is in this many receiver ranks' pools
        moved = hand_off(src, ep, sender, prompt, replicas)
        assert sender._plan is not None
        assert sum(t.direct is None for t in sender._plan.targets) == gathered
        assert staging().in_use == 0  # NOTE: every slot given back once its write completed
    finally:
        src.close()
        ep.close()
        ep.receiver.engine.close()
    assert_same_or_near_tie(ref_engine, [prompt], ref, [moved])


class CorruptStaged(NixlKVSender):
    """Flips one bit of layer 0's gathered K after its checks: as if the staged bytes had changed on the way."""

    def _checks(self, layer, slot=None):  # type: ignore[no-untyped-def]
        checks = super()._checks(layer, slot)
        if layer.index == 0 and slot is not None:
            slot.tensor[5] ^= 1
        return checks


def test_a_corrupted_staged_layer_fails_the_transfer_as_retryable_and_frees_it(models: dict[str, LoadedModel]) -> None:
    loaded = models["gqa-8q-4kv"]
    prompt = random_prompts(1, [45], vocab=loaded.config.vocab_size, seed=31)[0]
    src = engine(loaded, 2)
    ep = ReceiverEndpoint(engine(loaded, 1), TransferConfig(transport="nixl"), local_name="tp-kv-nixl-bad")
    dst = ep.receiver.engine
    try:
        baseline = free_blocks(dst)
        sender = open_kv_sender("nixl", ep.address, src, "x", prompt, sender_cls=CorruptStaged)
        prefill_layerwise(src, sender, prompt, greedy(1))
        assert sender.wait(10) is TransferState.FAILED and sender.error.retryable, sender.error
        assert "checksum mismatch in layer 0 K (nixl)" in sender.error.reason
        assert ep.receiver.poll("x") is TransferState.FAILED
        assert wait_for(lambda: free_blocks(dst) == baseline)  # NOTE: every layer's notification came: the fence lifts
        assert wait_for(lambda: staging().in_use == 0)
        assert_idle(src)
    finally:
        src.close()
        ep.close()
        dst.close()


class MissingHeads(NixlKVSender):
    """Says its pool holds only KV heads 0 and 1 of the model's 4."""

    def _prepare_request(self, req):  # type: ignore[no-untyped-def]
        return dataclasses.replace(super()._prepare_request(req), nixl_heads=[(0, 2)])


def test_nixl_refuses_a_sender_whose_pools_leave_a_kv_head_out(models: dict[str, LoadedModel]) -> None:
    loaded = models["gqa-8q-4kv"]
    prompt = random_prompts(1, [20], vocab=loaded.config.vocab_size, seed=3)[0]
    src = engine(loaded, 1)
    ep = ReceiverEndpoint(engine(loaded, 2), TransferConfig(transport="nixl"), local_name="tp-kv-nixl-heads")
    try:
        sender = open_kv_sender("nixl", ep.address, src, "x", prompt, sender_cls=MissingHeads)
        with pytest.raises(TransferError, match="nixl_heads: the ranks hold 2 of the model's 4 KV heads") as e:
            sender.prepare()
        assert not e.value.retryable and ep.receiver.num_inflight == 0
    finally:
        src.close()
        ep.close()
        ep.receiver.engine.close()
