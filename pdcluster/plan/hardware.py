"""Roofline profiles for GPUs we cannot measure here (H100, H200): ESTIMATED from published specs.

Each becomes the same step model as a measured profile (`pdcluster.plan.profile.StepModel`), so the simulator does
not care where a profile came from:
- c_tok = 2·(matmul params) / (peak FLOP/s × MFU): the matmuls, per token;
- knee = weight-read time / c_tok: below it a step is bound by reading the weights once (bandwidth × efficiency);
- c_seq = the logits matmul of one sampled row (2·vocab·hidden FLOPs) plus its share of reading the LM head;
- c_dec_key = KV bytes of one token / effective bandwidth (paged attention reads each sequence's keys: `sum`);
- c_pre_pair = 4·layers·heads·head_dim FLOPs per query·key pair / (FLOP/s × attention efficiency);
- c0 = a fixed per-step cost (scheduling, kernel launches; plus the all-reduces' latency under tensor parallelism).
The efficiencies are stated in each profile's notes; they are typical of vLLM/SGLang on these parts, not measured.

A tensor-parallel worker (TP n) is predicted from its parts as engine/parallel/ runs it, not by a flat efficiency:
each GPU computes one rank's shard (`rank_shape`: H/n query heads, max(1, KVH/n) KV heads, MLP width I/n) at one
GPU's FLOP/s and bandwidth; the LM head is split by vocabulary rows, each GPU computing and reading 1/n of it, and
the sampled rows' logits are gathered on rank 0 (one collective's latency in c0, (n-1)/n of a row's logits over
NVLink per sampled row in c_seq); every layer adds two ring all-reduces of [T, hidden] (a latency in c0 and 2(n-1)/n
of the activations' bytes over NVLink per token in c_tok); a rank reads its own KV heads.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from pdcluster.plan.profile import Profile, StepModel, TransferModel


@dataclass(frozen=True)
class Gpu:
    """Published peak figures of one GPU."""

    name: str
    bf16_tflops: float  # dense, no sparsity
    hbm_tb_s: float
    memory_gb: float  # HBM per GPU


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a Llama-family model."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    bytes_per_param: int = 2  # bf16

    @property
    def layer_params(self) -> int:
        """Matmul parameters of the decoder layers (q, k, v, o and the gated MLP)."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = h * self.num_heads * self.head_dim * 2 + h * kv * 2
        return self.num_layers * (attn + 3 * h * self.intermediate_size)

    def rank_shape(self, tp: int) -> ModelShape:
        """The part one GPU of a TP `tp` worker computes (engine/parallel/shard.py `rank_config`)."""
        if tp == 1:
            return self
        return dataclasses.replace(self, num_heads=self.num_heads // tp, num_kv_heads=max(1, self.num_kv_heads // tp),
                                   intermediate_size=self.intermediate_size // tp)

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param


H100 = Gpu("H100-SXM", 989.0, 3.35, 80.0)
H200 = Gpu("H200-SXM", 989.0, 4.8, 141.0)
GPUS = {"h100": H100, "h200": H200}

MODELS = {
    "smollm2-135m": ModelShape("SmolLM2-135M", 30, 576, 1536, 9, 3, 64, 49152, True),
    "llama-3.1-8b": ModelShape("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, 128256, False),
    "llama-3.1-70b": ModelShape("Llama-3.1-70B", 80, 8192, 28672, 64, 8, 128, 128256, False),
}
DEFAULT_TP = {"smollm2-135m": 1, "llama-3.1-8b": 1, "llama-3.1-70b": 8}

# profiles calibrated on a lent GPU's measured figures, shipped as files (written by pdcluster/plan/h200.py)
MEASURED = {"h200-measured": os.path.join(os.path.dirname(os.path.abspath(__file__)), "h200-llama-3.1-8b.json")}

MFU = 0.5  # matmul FLOP/s reached in prefill-sized GEMMs
ATTN_EFF = 0.4  # FlashAttention-style prefill attention, fraction of peak
BW_EFF = 0.75  # fraction of HBM bandwidth that weight and KV reads sustain
STEP_OVERHEAD_S = 0.003  # scheduler + launches per step (CUDA graphs for decode would cut it)
ALLREDUCE_S = 15e-6  # per all-reduce (NVLink, small messages): its latency; two per layer with tensor parallelism
NVLINK_GB_S = 360.0  # an all-reduce's bus bandwidth over NVLink (H100/H200 SXM: 450 GB/s per direction, ~80% kept)
IB_GB_S = 40.0  # KV between nodes: 400 Gb/s InfiniBand NDR per GPU ≈ 50 GB/s raw, ~40 GB/s effective
TRANSFER_LATENCY_S = 0.001  # handshake + commit round trips over the data-centre network


def roofline_profile(gpu: str, model: str = "llama-3.1-8b", tp: int | None = None) -> Profile:
    """An ESTIMATED profile of one worker: `tp` GPUs of kind `gpu` running `model` (tensor parallel)."""
    g, m = GPUS[gpu.lower()], MODELS[model.lower()]
    tp = tp or DEFAULT_TP[model.lower()]
    r = m.rank_shape(tp)  # one GPU's part
    flops = g.bf16_tflops * 1e12
    bw = g.hbm_tb_s * 1e12 * BW_EFF
    # NOTE: a ring all-reduce moves 2(n-1)/n of the [T, hidden] activations through each GPU's link, twice a layer
    allreduce_tok = 2 * m.num_layers * m.hidden_size * m.bytes_per_param * 2 * (tp - 1) / tp / (NVLINK_GB_S * 1e9)
    c_tok = 2 * r.layer_params / (flops * MFU) + allreduce_tok
    head = m.head_params / tp  # NOTE: each rank's vocabulary rows (engine/parallel/shard.py `vocab_rows`)
    weight_read = (r.layer_params + head) * m.bytes_per_param / bw
    gather_row = m.vocab_size * m.bytes_per_param * (tp - 1) / tp / (NVLINK_GB_S * 1e9)  # a row's logits to rank 0
    c_seq = 2 * head / (flops * MFU) + gather_row
    c0 = STEP_OVERHEAD_S + ((2 * m.num_layers + 1) * ALLREDUCE_S if tp > 1 else 0.0)
    step = StepModel(c0_s=c0, c_tok_s=c_tok, knee_tokens=weight_read / c_tok, c_seq_s=c_seq,
                     c_dec_key_s=r.kv_bytes_per_token / bw,
                     c_pre_pair_s=4 * m.num_layers * r.num_heads * m.head_dim / (flops * ATTN_EFF),
                     decode_attention="sum")
    # NOTE: each GPU of a tensor-parallel worker sends its own shard of the KV over its own NIC.
    transfer = TransferModel(bandwidth_gb_s=IB_GB_S * tp, latency_s=TRANSFER_LATENCY_S, num_layers=m.num_layers)
    return Profile(
        hardware=f"{g.name} x{tp}" if tp > 1 else g.name, model=m.name, threads=1, gpus_per_worker=tp,
        estimated=True, source=f"roofline from published specs: {g.bf16_tflops:g} TFLOP/s dense bf16, "
                               f"{g.hbm_tb_s:g} TB/s HBM per GPU",
        step=step, transfer=transfer, kv_bytes_per_token=m.kv_bytes_per_token, gpu_memory_gb=g.memory_gb,
        notes=[f"ESTIMATED, not measured: MFU {MFU:.0%}, attention {ATTN_EFF:.0%} of peak, {BW_EFF:.0%} of HBM "
               f"bandwidth, {STEP_OVERHEAD_S * 1e3:g} ms per step",
               *([f"tensor parallel {tp}, predicted from its parts: one GPU computes {r.num_heads} of {m.num_heads} "
                  f"heads, {r.num_kv_heads} KV head(s), MLP width {r.intermediate_size}, 1/{tp} of the LM head's "
                  f"vocabulary (its logits gathered on rank 0); 2 ring all-reduces per layer at "
                  f"{ALLREDUCE_S * 1e6:g} us + {NVLINK_GB_S:g} GB/s NVLink "
                  f"({allreduce_tok * 1e6:.2f} us per token)"] if tp > 1 else []),
               f"KV transfer {IB_GB_S:g} GB/s per GPU (400 Gb/s InfiniBand), {TRANSFER_LATENCY_S * 1e3:g} ms "
               f"per transfer, layer-wise", f"weights {(m.layer_params + m.head_params) * 2 / 1e9:.1f} GB bf16"
               + (f" ({(r.layer_params + head) * 2 / 1e9:.1f} GB per GPU: its shard and 1/{tp} of the LM head)"
                  if tp > 1 else "") + f"; batch-1 decode reads them once per step: {weight_read * 1e3:.2f} ms"])


def resolve_profile(spec: str) -> Profile:
    """A profile from a JSON path, `h100`/`h200` optionally with a model (`h100:llama-3.1-70b`), or `h200-measured`
    (Llama-3.1-8B on the H200 from its measured figures)."""
    if spec.lower() in MEASURED:
        return Profile.load(MEASURED[spec.lower()])
    name, _, model = spec.partition(":")
    if name.lower() in GPUS:
        return roofline_profile(name, model or "llama-3.1-8b")
    return Profile.load(spec)
