"""The engine gives the same tokens with prefill attention as one fused SDPA call per chunk (prefill="flash", the
default) as with the 128-row chunked path it replaced: shared and unshared prefixes, chunked prefill, preemption,
on the kernel path and on the pure-torch gather path."""

from __future__ import annotations

import pytest

from engine import LLMEngine
from engine.attention import AttentionMetadata
from engine.kernels import ENV, ensure_built
from engine.loader import LoadedModel
from tests.helpers import first_then_rest, make_engine
from tests.test_attention_engine import OTHERS, QUESTIONS, SYSTEM


@pytest.fixture(scope="module", autouse=True)
def kernel():
    return ensure_built()


def _engine(loaded: LoadedModel, backend: str, prefill: str, monkeypatch: pytest.MonkeyPatch,
            **cfg: object) -> LLMEngine:
    monkeypatch.setenv(ENV, backend)
    engine = make_engine(loaded, **cfg)
    engine.runner.attn_prefill = prefill  # type: ignore[assignment]
    return engine


@pytest.fixture
def modes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bool, bool]]:
    """(flash, has_context) of every prefill chunk attended with SDPA (a spy on the real build)."""
    seen: list[tuple[bool, bool]] = []
    build = AttentionMetadata.build

    def spy(*args: object, **kwargs: object) -> AttentionMetadata:
        meta = build(*args, **kwargs)  # type: ignore[arg-type]
        seen.extend((s.flash, s.has_context) for s in meta.prefills if not s.in_plan)
        return meta

    monkeypatch.setattr(AttentionMetadata, "build", staticmethod(spy))
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["kernel", "gather"])
def test_shared_and_unshared_prefixes_same_tokens(smollm2, monkeypatch, modes, backend) -> None:
    enc = smollm2.tokenizer.encode
    system = enc(SYSTEM)[:144]  # 9 full blocks
    # NOTE: a 100-token suffix behind the cached system prompt: a chunk with context too long for the kernel
    first = system + enc(QUESTIONS[0])
    rest = [system + enc(q) for q in QUESTIONS[1:]] + [enc(o) for o in OTHERS] + [system + enc(SYSTEM)[:100]]
    out = {}
    for prefill in ("chunked", "flash"):
        engine = _engine(smollm2, backend, prefill, monkeypatch)
        modes.clear()
        out[prefill] = first_then_rest(engine, first, rest, 16)
        assert engine.stats().cached_prompt_tokens >= 4 * 144
        assert {flash for flash, _ in modes} == {prefill == "flash"}
        assert (prefill == "flash", True) in modes and (prefill == "flash", False) in modes
    assert out["flash"] == out["chunked"]


@pytest.mark.slow
def test_chunked_prefill_and_preemption_same_tokens(smollm2, monkeypatch, modes) -> None:
    enc = smollm2.tokenizer.encode
    prompts = [(enc(SYSTEM + " " + q) * 2)[:110] for q in QUESTIONS[:4]]
    out, stats = {}, {}
    for prefill in ("chunked", "flash"):
        # NOTE: 64-token steps split every prompt into chunks with cached context; 24 blocks cannot hold four
        # sequences of ~150 tokens, so some are preempted and recomputed.
        engine = _engine(smollm2, "kernel", prefill, monkeypatch, num_blocks=24, max_num_batched_tokens=64,
                         enable_prefix_caching=False)
        modes.clear()
        out[prefill] = first_then_rest(engine, prompts[0], prompts[1:], 40)
        stats[prefill] = engine.stats()
        assert (prefill == "flash", True) in modes  # chunks attended their cached context with this path
    assert out["flash"] == out["chunked"]
    assert stats["flash"].num_preemptions > 0 and stats["chunked"].num_preemptions > 0
