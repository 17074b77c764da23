"""The step-time model every simulated worker shares, its least-squares fit, and the KV transfer model.

One engine step computes a batch (decode entries of one token, prefill chunks) and costs

    t = c0 + c_tok·max(T, knee) + c_seq·S + c_dec·K_dec + c_pre·P_pre

T: tokens in the step; S: sequences that sample a token (every decode entry, a prompt's last chunk);
K_dec: keys the decode entries attend to (`padded`: entries × the longest context, as our CPU engine gathers them;
`sum`: Σ contexts, as paged-attention kernels read them); P_pre: query·key pairs of the prefill chunks
(Σ n_i·(start_i + (n_i + 1)/2), causal). NOTE: `max(T, knee)` is the roofline in one term: below `knee` tokens
a step is bound by reading the weights (c_tok·knee), above it by the matmuls; knee 0 is the plain linear model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class StepModel(BaseModel):
    """Coefficients of the step-time model (seconds)."""

    model_config = ConfigDict(extra="forbid")

    c0_s: float = Field(ge=0, description="fixed cost of a step (scheduling, launch, sampling setup)")
    c_tok_s: float = Field(ge=0, description="per token computed (the matmuls)")
    knee_tokens: float = Field(default=0.0, ge=0, description="below this many tokens a step costs as many")
    c_seq_s: float = Field(default=0.0, ge=0, description="per sequence that samples (logits row, sampler)")
    c_dec_key_s: float = Field(default=0.0, ge=0, description="per key a decode entry attends to")
    c_pre_pair_s: float = Field(default=0.0, ge=0, description="per query·key pair of prefill attention")
    decode_attention: Literal["padded", "sum"] = Field(default="padded", description="how decode keys count")

    def time(self, tokens: float, samples: float, dec_keys: float, pre_pairs: float) -> float:
        """Seconds for one step with these features."""
        return (self.c0_s + self.c_tok_s * max(tokens, self.knee_tokens) + self.c_seq_s * samples
                + self.c_dec_key_s * dec_keys + self.c_pre_pair_s * pre_pairs)

    def prefill_time(self, n: int, start: int = 0) -> float:
        """One step prefilling `n` tokens after `start` cached ones, alone, sampling at its end."""
        return self.time(n, 1, 0, prefill_pairs(n, start))

    def decode_time(self, batch: int, context: int) -> float:
        """One step of `batch` decode entries, each attending to `context` keys."""
        return self.time(batch, batch, batch * context, 0)

    def speed_tok_s(self, n: int = 512) -> float:
        """Prefill speed (tokens/s) of an `n`-token prompt alone: what the router's TTFT estimate divides by."""
        return n / self.prefill_time(n)


def prefill_pairs(n: int, start: int) -> float:
    """Query·key pairs of a causal chunk of `n` tokens after `start` tokens of context."""
    return n * (start + (n + 1) / 2)


class TransferModel(BaseModel):
    """Moving a prompt's KV from a prefill to a decode worker: bandwidth, a fixed cost, layer-wise overlap."""

    model_config = ConfigDict(extra="forbid")

    bandwidth_gb_s: float = Field(gt=0, description="sustained bytes/s of the transport (GB = 1e9 bytes)")
    latency_s: float = Field(default=0.0, ge=0, description="fixed cost per transfer (handshake, commit, DONE)")
    num_layers: int = Field(default=1, gt=0, description="layers sent one by one while the prefill computes")
    layerwise: bool = Field(default=True, description="each layer is sent as soon as the final step wrote it")

    def tail_s(self, nbytes: float, last_step_s: float) -> float:
        """Transfer time left after the prefill's last step ends.

        NOTE: layer i's KV is ready at (i+1)/L of the last step and takes X/L to send (X: the whole payload), so
        the last byte lands at max(dt/L + X, dt + X/L) after the step began; only what is past dt is a tail.
        """
        x = nbytes / (self.bandwidth_gb_s * 1e9)
        if not self.layerwise:
            return x + self.latency_s
        n, dt = self.num_layers, last_step_s
        return max(dt / n + x - dt, x / n, 0.0) + self.latency_s


class FitStats(BaseModel):
    """How well the step model reproduces the measured steps (relative errors, %)."""

    model_config = ConfigDict(extra="forbid")

    num_steps: int
    mean_abs_pct: float
    p90_abs_pct: float
    max_abs_pct: float
    by_kind: dict[str, float] = Field(default_factory=dict, description="mean |error| % per kind of step")


class Profile(BaseModel):
    """Everything the simulator needs to know about one worker of a given hardware and model."""

    model_config = ConfigDict(extra="forbid")

    hardware: str
    model: str
    threads: int = 1
    gpus_per_worker: int = Field(default=1, gt=0, description="what one worker costs (GPUs, or cores on a CPU)")
    estimated: bool = Field(description="true: derived from published specs (roofline), not measured here")
    device: Literal["cpu", "cuda"] | None = Field(
        default=None, description="where a worker computes; null: cuda for an estimated profile, else cpu")
    source: str = ""
    step: StepModel
    transfer: TransferModel
    kv_bytes_per_token: int = Field(gt=0)
    gpu_memory_gb: float | None = Field(default=None, gt=0, description="memory of one GPU (a plan's node "
                                        "requirements); null: not stated (CPU profiles)")
    fit: FitStats | None = None
    notes: list[str] = Field(default_factory=list)

    @property
    def on_gpu(self) -> bool:
        """Whether a worker of this profile is a GPU (the GPU deploy template and overheads apply)."""
        return self.device == "cuda" or (self.device is None and self.estimated)

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.model_dump(), f, indent=2)

    @classmethod
    def load(cls, path: str) -> Profile:
        with open(path) as f:
            return cls.model_validate(json.load(f))


# ---- fitting ----------------------------------------------------------------------------------------------------
FEATURES = ("tokens", "samples", "dec_keys", "pre_pairs")
KNEES = (0, 1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def _nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with coefficients ≥ 0: drop the most negative column and refit until none is negative."""
    active = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        coef[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
        neg = [i for i in active if coef[i] < 0]
        if not neg:
            return coef
        active.remove(min(neg, key=lambda i: coef[i]))


def fit_step_model(rows: Sequence[dict[str, Any]], decode_attention: Literal["padded", "sum"] = "padded",
                   knees: Sequence[float] = KNEES) -> tuple[StepModel, FitStats]:
    """Fit the coefficients to measured steps (dicts of FEATURES, `seconds` and `kind`), minimising relative error.

    NOTE: each row is divided by its measured time, so a 30 ms decode step weighs as much as a 3 s prefill; the
    knee is searched on a grid (the model is linear for a fixed knee).
    """
    y = np.array([r["seconds"] for r in rows])
    feats = np.array([[r[f] for f in FEATURES] for r in rows])
    best: tuple[float, StepModel] | None = None
    for knee in knees:
        a = np.column_stack([np.ones(len(rows)), np.maximum(feats[:, 0], knee), feats[:, 1:]])
        coef = _nonneg_lstsq(a / y[:, None], np.ones(len(rows)))
        err = float(np.sum((a @ coef / y - 1) ** 2))
        model = StepModel(c0_s=coef[0], c_tok_s=coef[1], knee_tokens=knee, c_seq_s=coef[2], c_dec_key_s=coef[3],
                          c_pre_pair_s=coef[4], decode_attention=decode_attention)
        if best is None or err < best[0]:
            best = (err, model)
    assert best is not None
    return best[1], fit_stats(best[1], rows)


def fit_stats(model: StepModel, rows: Sequence[dict[str, Any]]) -> FitStats:
    """Relative errors of `model` on measured rows."""
    errs = [abs(model.time(*(r[f] for f in FEATURES)) / r["seconds"] - 1) * 100 for r in rows]
    kinds: dict[str, list[float]] = {}
    for r, e in zip(rows, errs):
        kinds.setdefault(str(r.get("kind", "step")), []).append(e)
    return FitStats(num_steps=len(rows), mean_abs_pct=round(float(np.mean(errs)), 2),
                    p90_abs_pct=round(float(np.percentile(errs, 90)), 2), max_abs_pct=round(max(errs), 2),
                    by_kind={k: round(float(np.mean(v)), 2) for k, v in kinds.items()})


def describe(p: Profile) -> str:
    """A few lines a person can check: the coefficients and what they mean for prefill and decode."""
    s = p.step
    kind = "ESTIMATED from published specs" if p.estimated else f"measured, {p.threads} torch thread(s)"
    lines = [f"profile {p.hardware} / {p.model} ({kind}; a worker costs {p.gpus_per_worker})",
             f"  step = {s.c0_s * 1e3:.2f} ms + {s.c_tok_s * 1e3:.4f} ms x max(tokens, {s.knee_tokens:g}) + "
             f"{s.c_seq_s * 1e3:.3f} ms x samples + {s.c_dec_key_s * 1e6:.4f} us x decode keys ({s.decode_attention})"
             f" + {s.c_pre_pair_s * 1e9:.4f} ns x prefill pairs",
             f"  prefill 512 tokens {s.prefill_time(512) * 1e3:.1f} ms ({s.speed_tok_s():.0f} tok/s); decode step "
             f"batch 1 @ 512 ctx {s.decode_time(1, 512) * 1e3:.2f} ms, batch 32 @ 512 ctx "
             f"{s.decode_time(32, 512) * 1e3:.2f} ms",
             f"  KV {p.kv_bytes_per_token} B/token; transfer {p.transfer.bandwidth_gb_s:g} GB/s + "
             f"{p.transfer.latency_s * 1e3:.2f} ms{', layer-wise' if p.transfer.layerwise else ''}"]
    if p.fit:
        f = p.fit
        lines.append(f"  fit on {f.num_steps} steps: mean |err| {f.mean_abs_pct:.1f}%, p90 {f.p90_abs_pct:.1f}%, "
                     f"max {f.max_abs_pct:.1f}%; by kind " + ", ".join(f"{k} {v:.1f}%" for k, v in f.by_kind.items()))
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)
