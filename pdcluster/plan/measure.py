"""`pdcluster plan profile`: time real engine steps on this machine and fit the step model to them.

What is measured (each a whole `LLMEngine.step()`: scheduling, forward, sampling, output processing):
1. prefill-only steps of 16..1024 fresh tokens, and chunks of 256 after a cached prefix of 512/1024 (attention
   over context);
2. decode steps at batch 1..32 and contexts 64..2048 (the batch shares its prompt through the prefix cache, so
   setting up a context costs one prefill; the attention still reads every sequence's keys), plus batches with
   one long and many short contexts (the engine groups decode entries by length, so they cost about their sum);
3. mixed steps: decodes plus a new prompt's chunk, what a colocated worker runs.
The process pins itself to one core with one torch thread, as each benchmark worker is.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from pdcluster.bench.report import machine
from pdcluster.plan.profile import FitStats, Profile, StepModel, TransferModel, fit_step_model, prefill_pairs

# NOTE: defaults from BENCHMARKS.md "KV transfer": grpc moves ~0.85 GB/s here, and layer-wise sending leaves 3-5 ms
# after a 2048-token prefill (the handshake and commit round trips).
CPU_TRANSFER_GB_S = 0.85
CPU_TRANSFER_LATENCY_S = 0.004

PREFILL_LENS = (16, 32, 64, 128, 256, 384, 512, 768, 1024)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (64, 512, 1024, 2048)
DECODE_STEPS = 4
MMAP_MAX_BYTES = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit


class _Probe:
    """An engine whose runner records each step's features; `step()` returns them with the step's seconds."""

    def __init__(self, model: str, threads: int) -> None:
        import torch

        from engine import EngineConfig, LLMEngine
        from engine.loader import load_model

        torch.set_num_threads(threads)
        loaded = load_model(model)
        self.cfg = loaded.config
        self.kv_token_bytes_per_layer = self.cfg.num_kv_heads * self.cfg.head_dim * 4  # K (or V) of one token, fp32
        self.engine = LLMEngine(loaded, EngineConfig(num_threads=threads, num_blocks=1536, max_num_seqs=64,
                                                     max_num_batched_tokens=2048))
        self.rng = random.Random(0)
        self.n = 0
        self._feats: dict[str, float] = {}
        execute = self.engine.runner.execute

        def recording(batch: Any, *args: Any, **kwargs: Any) -> Any:
            self._feats = features(batch)
            return execute(batch, *args, **kwargs)
        self.engine.runner.execute = recording  # type: ignore[method-assign, assignment]

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(256, self.cfg.vocab_size) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> str:
        from engine import SamplingParams

        self.n += 1
        rid = f"p{self.n}"
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return rid

    def step(self, kind: str) -> dict[str, float | str]:
        t = time.perf_counter()
        self.engine.step()
        return {**self._feats, "seconds": time.perf_counter() - t, "kind": kind}

    def settle(self) -> None:
        """Step until every request is decoding (its prompt computed, a token sampled)."""
        sched = self.engine.scheduler
        while sched.waiting or any(s.num_output_tokens == 0 for s in sched.running):
            self.engine.step()

    def clear(self) -> None:
        for rid in list(self.engine._seqs):
            self.engine.abort_request(rid)


def warm_allocator() -> None:
    """Raise glibc's dynamic mmap threshold to its 32 MiB cap, as a long-running worker's history does.

    NOTE: the decode gather (`index_select` of every sequence's keys, per layer) allocates a fresh tensor of
    batch x context x KV bytes. glibc serves an allocation above its mmap threshold with a fresh mmap and page-faults
    it in, and only raises the threshold once such a chunk is freed: a fresh process ran batch-16 decode steps at
    1,024 context 2.7x slower (670 vs 245 ms here) than one that had freed a big chunk. Gathers over 32 MiB are always
    mmapped; the profile leaves them out (MMAP_MAX_BYTES).
    """
    import torch

    x = torch.empty(MMAP_MAX_BYTES // 4 - 4096)
    x.fill_(0)
    del x


def features(batch: Any) -> dict[str, float]:
    """The step model's features of a scheduled batch (called before the runner computes it)."""
    tokens = samples = 0
    dec_n, dec_max, dec_sum, pairs = 0, 0, 0, 0.0
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        tokens += n
        samples += start + n == len(seq)
        if n == 1:  # NOTE: the engine's attention treats every single-token entry as a decode entry
            dec_n, dec_max, dec_sum = dec_n + 1, max(dec_max, start + 1), dec_sum + start + 1
        else:
            pairs += prefill_pairs(n, start)
    # NOTE: the engine attends decode entries in groups padded to at most 2x their shortest (engine/attention/paged.py),
    # so their keys cost about their sum; the padded count is kept for reference
    return {"tokens": tokens, "samples": samples, "dec_keys": dec_sum, "dec_keys_padded": dec_n * dec_max,
            "pre_pairs": pairs}


def measure(model: str = "smollm2", threads: int = 1, repeats: int = 2,
            log: Callable[[str], None] = print) -> list[dict[str, float | str]]:
    """Time prefill, decode and mixed steps of the real engine; one row per step."""
    p = _Probe(model, threads)
    rows: list[dict[str, float | str]] = []
    warm_allocator()
    for _ in range(2):  # warm-up: allocator, oneDNN primitives
        p.add(p.tokens(64), 3)
        while p.engine.has_unfinished_requests():
            p.engine.step()
    log(f"prefill steps: {PREFILL_LENS} tokens x {repeats}")
    for n in PREFILL_LENS:
        for _ in range(repeats):
            p.add(p.tokens(n), 1)
            rows.append(p.step("prefill"))
    base = p.tokens(1024)
    p.add(base, 1)
    rows.append(p.step("prefill"))
    for cached in (512, 1024):
        for _ in range(repeats):
            p.add(base[:cached] + p.tokens(256), 1)
            rows.append(p.step("prefill_ctx"))
    limit = p.engine.max_model_len - DECODE_STEPS - 4  # NOTE: room for the tokens each context generates
    contexts = [c for c in DECODE_CONTEXTS if c <= limit]
    log(f"decode steps: batch {DECODE_BATCHES} x context {contexts}")
    for ctx in contexts:
        shared = p.tokens(ctx)
        p.add(shared, 1)
        rows.append(p.step("prefill"))
        for b in DECODE_BATCHES:
            if b * ctx * p.kv_token_bytes_per_layer > MMAP_MAX_BYTES:
                continue
            for _ in range(b):
                p.add(shared + p.tokens(1), DECODE_STEPS + 2)
            p.settle()  # NOTE: each computes one token (its prompt's last) after the cached prefix
            rows += [p.step("decode") for _ in range(DECODE_STEPS)]
            p.clear()
    log("padded decode: one long context among short ones")
    long_p, short_p = p.tokens(min(2048, limit)), p.tokens(64)
    for b in (4, 16):
        p.add(long_p, DECODE_STEPS + 2)
        for _ in range(b - 1):
            p.add(short_p + p.tokens(1), DECODE_STEPS + 2)
        p.settle()
        rows += [p.step("decode_mixed_ctx") for _ in range(DECODE_STEPS)]
        p.clear()
    log("mixed steps: decodes + a new prompt")
    shared = p.tokens(512)
    p.add(shared, 1)
    p.step("setup")
    for b in (4, 16):
        for n in (128, 512, 1000):
            for _ in range(b):
                p.add(shared + p.tokens(1), 8)
            p.settle()
            p.add(p.tokens(n), 1)
            rows.append(p.step("mixed"))
            p.clear()
    return rows


def profile_here(model: str = "smollm2", threads: int = 1, core: int | None = None, repeats: int = 2,
                 log: Callable[[str], None] = print) -> tuple[Profile, list[dict[str, float | str]]]:
    """Measure and fit a profile of this machine; returns it and the measured rows."""
    import torch

    from engine.loader import load_model

    cores = sorted(os.sched_getaffinity(0))
    core = cores[-1] if core is None else core
    before = torch.get_num_threads()
    os.sched_setaffinity(0, {core})  # NOTE: like a benchmark worker (cpu_affinity: one core, one torch thread)
    started = time.perf_counter()
    try:
        rows = measure(model, threads, repeats, log)
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(before)
    numeric = [r for r in rows if r["kind"] != "setup"]
    step, stats = fit_step_model(numeric, "sum")
    cfg = load_model(model).config
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # fp32
    secs = statistics.median(float(r["seconds"]) for r in numeric if r["kind"] == "decode")
    log(f"measured {len(numeric)} steps in {time.perf_counter() - started:.0f} s (median decode step "
        f"{secs * 1e3:.1f} ms)")
    here = machine()
    prof = Profile(hardware=f"cpu:{here['cpu']} ({here['cores']} cores), core {core}", model=model, threads=threads,
                   gpus_per_worker=1, estimated=False, source="measured by `pdcluster plan profile`",
                   step=step, transfer=TransferModel(bandwidth_gb_s=CPU_TRANSFER_GB_S, latency_s=CPU_TRANSFER_LATENCY_S,
                                                     num_layers=cfg.num_layers),
                   kv_bytes_per_token=kv, fit=stats,
                   notes=["transfer bandwidth/latency from BENCHMARKS.md (grpc, CPU), not measured by this command",
                          "one worker costs one core (gpus_per_worker counts cores on a CPU)"])
    return prof, rows


def refit(rows: list[dict[str, Any]], prof: Profile) -> tuple[StepModel, FitStats]:
    """The fit again from saved rows (to try other knees or check a profile)."""
    return fit_step_model([r for r in rows if r["kind"] != "setup"], prof.step.decode_attention)
