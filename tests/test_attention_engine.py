"""The engine gives the same tokens with the compiled in-place attention (and cascade over shared prefixes) as
with the pure-torch gather path: shared and unshared prefixes, chunked prefill, preemption, int8 KV."""

from __future__ import annotations

import pytest

from engine import LLMEngine
from engine.attention import AttentionMetadata
from engine.kernels import ENV, ensure_built
from engine.loader import LoadedModel
from tests.helpers import first_then_rest, make_engine


@pytest.fixture(scope="module", autouse=True)
def kernel():
    return ensure_built()


def _engine(loaded: LoadedModel, backend: str, monkeypatch: pytest.MonkeyPatch, **cfg: object) -> LLMEngine:
    monkeypatch.setenv(ENV, backend)
    engine = make_engine(loaded, **cfg)
    assert (engine.runner.attn_kernel is not None) == (backend == "kernel")
    return engine


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[AttentionMetadata]:
    """Every step's attention metadata (a spy on the real build)."""
    seen: list[AttentionMetadata] = []
    build = AttentionMetadata.build

    def spy(*args: object, **kwargs: object) -> AttentionMetadata:
        meta = build(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(meta)
        return meta

    monkeypatch.setattr(AttentionMetadata, "build", staticmethod(spy))
    return seen


SYSTEM = ("You are a careful assistant for a public library. Answer questions about opening hours, borrowing "
          "rules, reading rooms, events and the catalogue. Keep answers short and friendly, say when you do not know, "
          "and never invent a book that is not in the catalogue. The library opens at nine in the morning on weekdays "
          "and at ten on Saturdays; it is closed on Sundays and public holidays. Members may borrow up to twelve "
          "items for three weeks and renew them twice online. Late returns cost ten cents a day per item, "
          "children's books excepted. The "
          "quiet reading room is on the second floor, the group study rooms can be booked a week ahead at the front "
          "desk, and the café on the ground floor serves coffee until four in the afternoon.")
QUESTIONS = ["When do you open on Saturday?", "How many books can I borrow?", "Can I renew a loan online?",
             "Are you open on Sunday?", "Tell me about the reading rooms."]
OTHERS = ["The quick brown fox jumps over the lazy dog. Write a story about the fox and the dog:",
          "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"]


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_shared_and_unshared_prefixes_same_tokens(smollm2, monkeypatch, plans, kv_cache_dtype) -> None:
    enc = smollm2.tokenizer.encode
    system = enc(SYSTEM)[:144]  # 9 full blocks
    first, rest = system + enc(QUESTIONS[0]), [system + enc(q) for q in QUESTIONS[1:]] + [enc(o) for o in OTHERS]
    out = {}
    for backend in ("gather", "kernel"):
        engine = _engine(smollm2, backend, monkeypatch, kv_cache_dtype=kv_cache_dtype)
        plans.clear()
        # NOTE: int8 KV (coarser logits) met a near-tie at the 16th token of one prompt, where the two paths' attention
        # outputs differed by 5e-6 (summation order); the numeric tests in test_attention.py bound that difference.
        out[backend] = first_then_rest(engine, first, rest, 16 if kv_cache_dtype == "auto" else 12)
        assert engine.stats().cached_prompt_tokens >= 4 * 144  # the followers' system prompt came from the cache
    assert out["kernel"] == out["gather"]
    # the five sequences behind the system prompt decoded as one cascade group over its 9 full blocks
    groups = [g for m in plans if m.plan for g in m.plan.groups]
    assert groups and max(len(g.members) for g in groups) == 5
    assert max(g.num_tokens for g in groups) == 144


@pytest.mark.slow
def test_chunked_prefill_and_preemption_same_tokens(smollm2, monkeypatch, plans) -> None:
    enc = smollm2.tokenizer.encode
    prompts = [(enc(SYSTEM + " " + q) * 2)[:110] for q in QUESTIONS[:4]]
    out, stats = {}, {}
    for backend in ("gather", "kernel"):
        # NOTE: 64-token steps split every prompt into chunks with cached context; 24 blocks cannot hold four
        # sequences of ~150 tokens, so some are preempted and recomputed.
        engine = _engine(smollm2, backend, monkeypatch, num_blocks=24, max_num_batched_tokens=64,
                         enable_prefix_caching=False)
        plans.clear()
        out[backend] = first_then_rest(engine, prompts[0], prompts[1:], 40)
        stats[backend] = engine.stats()
    assert out["kernel"] == out["gather"]
    assert stats["kernel"].num_preemptions > 0 and stats["gather"].num_preemptions > 0
    assert any(s.has_context for m in plans for s in m.prefills)  # chunks attended their cached context
