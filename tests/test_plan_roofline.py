"""The planner's roofline profiles (pdcluster/plan/hardware.py): ESTIMATED GPU workers, tensor parallel ones
predicted from their parts."""

from __future__ import annotations

import pytest

from pdcluster.plan import hardware


def test_roofline_decode_step_at_batch_1_is_reading_the_weights_once():
    prof = hardware.roofline_profile("h100", "llama-3.1-8b")
    m = hardware.MODELS["llama-3.1-8b"]
    weights = (m.layer_params + m.head_params) * 2
    assert 15e9 < weights < 16.5e9  # Llama-3.1-8B in bf16, without the input embedding
    read = weights / (3.35e12 * hardware.BW_EFF)
    t = prof.step.decode_time(1, 1)
    assert t == pytest.approx(hardware.STEP_OVERHEAD_S + read, rel=0.02)
    assert prof.estimated and "ESTIMATED" in prof.notes[0]
    # H200 has the same FLOP/s and 43% more bandwidth: decode is faster, a long prefill is not
    h200 = hardware.roofline_profile("h200", "llama-3.1-8b")
    assert h200.step.decode_time(1, 1) < 0.8 * t
    assert h200.step.prefill_time(4096) == pytest.approx(prof.step.prefill_time(4096), rel=0.01)


def test_seventy_b_profile_is_eight_gpus_per_worker():
    prof = hardware.resolve_profile("h100:llama-3.1-70b")
    assert prof.gpus_per_worker == 8 and prof.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_a_tensor_parallel_worker_is_predicted_from_its_parts():
    m = hardware.MODELS["llama-3.1-70b"]
    prof = hardware.roofline_profile("h100", "llama-3.1-70b")
    one = hardware.roofline_profile("h100", "llama-3.1-70b", 1)
    r = m.rank_shape(8)  # one GPU's part, as engine/parallel/shard.py cuts it: 1 KV head each
    assert (r.num_heads, r.num_kv_heads, r.intermediate_size) == (8, 1, 3584)
    # batch-1 decode: each GPU reads its shard and an eighth of the LM head, plus 2 all-reduces per layer and the
    # logits' gather on rank 0
    read = (r.layer_params + m.head_params / 8) * 2 / (3.35e12 * hardware.BW_EFF)
    assert prof.step.decode_time(1, 1) == pytest.approx(
        hardware.STEP_OVERHEAD_S + (2 * 80 + 1) * hardware.ALLREDUCE_S + read, rel=0.02)
    # per token: an eighth of the matmuls plus the all-reduces' bytes
    allreduce_tok = 2 * 80 * 8192 * 2 * (2 * 7 / 8) / (hardware.NVLINK_GB_S * 1e9)
    assert prof.step.c_tok_s == pytest.approx(one.step.c_tok_s * r.layer_params / m.layer_params + allreduce_tok)
    # per sampled row: an eighth of the head's matmul, plus 7/8 of its logits' bf16 bytes to rank 0 over NVLink
    gather = 128256 * 2 * 7 / 8 / (hardware.NVLINK_GB_S * 1e9)
    assert prof.step.c_seq_s == pytest.approx(one.step.c_seq_s / 8 + gather)
    assert prof.estimated and any("predicted from its parts" in n for n in prof.notes)
