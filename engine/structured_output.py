"""Structured outputs with xgrammar: the output follows a JSON schema, any JSON object, a regex, one of a list of
choices or an EBNF grammar (the library vLLM and SGLang use, the same calls).

Life of a structured request:
1. the router builds a `StructuredOutputSpec` from the request and `check_spec` (engine/grammar.py) builds its
   grammar without the vocabulary (about a millisecond; cached per spec): a bad one is a 400 naming the field;
2. an engine's `add_request` / `commit_kv` hand the sequence to `StructuredOutputs.admit`: the grammar is compiled
   against the model's vocabulary on a worker thread (cached per spec); until it is ready the sequence is parked,
   neither queued nor scheduled, and the engine loop goes on stepping the others (a grammar that does not build,
   which only an engine used directly can be given, ends its request with "abort");
3. once compiled, the sequence gets a GrammarMatcher fed the output tokens it already has: the first token from the
   prefill worker, or those a failed decode worker streamed. So the grammar's state crosses the prefill -> decode
   handoff and a decode failover without travelling: it is rebuilt from the emitted tokens;
4. each step the runner asks `grammar_bitmask` for the sampling rows' allowed tokens (xgrammar's format: int32
   [N, ceil(V/32)], bit set = allowed; None when no row has a grammar) and hands it to the sampler, whose pipeline
   sets the other tokens' logits to -inf before the penalties, logprobs and temperature (engine/sampler.py);
   `apply_token_bitmask` here does the same in place with xgrammar's CPU kernel on the constrained rows only;
5. every appended token advances the matcher (`accept`); a complete output allows only EOS, and the EOS ends the
   request with "stop" (ignore_eos is refused with a grammar for that reason).

NOTE: the grammar is compiled in the engine, off its loop thread, rather than in the worker before the request
reaches the engine: every way into an engine (a new request, a handed-off one, a failover, the offline `LLM`) gets
the same compile-once-and-park without each worker having to know about grammars.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import TYPE_CHECKING, Any

import torch

from engine.grammar import GrammarState, StructuredOutputSpec, build_grammar

if TYPE_CHECKING:
    from engine.sequence import Sequence as Seq
    from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
MAX_CACHED_GRAMMARS = 256  # compiled grammars an engine keeps (least recently used dropped)


# ---- the logits side (any device) -------------------------------------------------------------------------------
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set `logits[i, t]` to -inf where bit t of row i of `bitmask` is 0, in place.

    logits: [N, V] float; bitmask: int32 [N, ceil(V/32)] (xgrammar's format: bit t % 32 of word t // 32 = token t
    allowed). Rows of all ones (-1) are left alone. On CPU it is xgrammar's own kernel over the constrained rows;
    elsewhere a few elementwise torch ops (no host sync), since xgrammar's CUDA kernel is compiled at first use.
    """
    n, vocab = logits.shape
    assert bitmask.shape == (n, (vocab + 31) // 32), (bitmask.shape, logits.shape)
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and bitmask.device.type == "cpu":
        import xgrammar as xgr

        rows = (bitmask != -1).any(-1).nonzero().flatten().tolist()
        if rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        return
    apply_token_bitmask_torch(logits, bitmask)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """apply_token_bitmask in plain torch ops, on any device (the bitmask is moved to the logits' device)."""
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(logits.device, non_blocking=True)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [N, W, 32] → [N, V]
    logits.masked_fill_(~allowed, float("-inf"))


def grammar_bitmask(seqs: Sequence[Seq], vocab_size: int) -> torch.Tensor | None:
    """The allowed tokens of each sequence's next token, int32 [N, ceil(V/32)]; None when no sequence has a grammar
    (rows of sequences without one allow everything)."""
    if all(s.grammar is None for s in seqs):
        return None
    bitmask = torch.full((len(seqs), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for i, s in enumerate(seqs):
        if s.grammar is not None and s.grammar.matcher is not None:
            s.grammar.matcher.fill_next_token_bitmask(bitmask, i)
    return bitmask


# ---- the engine side --------------------------------------------------------------------------------------------
class GrammarCompiler:
    """Compiles specs against one model's vocabulary on one worker thread, caching each spec's compiled grammar."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: Any = None  # built on the worker thread at the first compile (~0.15 s for a 49k vocabulary)
        self._pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[StructuredOutputSpec, Future[Any]] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputSpec) -> Future[Any]:
        """The spec's compiled grammar, a future: done at once when cached, else compiled off the calling thread."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None and not (fut.done() and fut.exception() is not None):
                self._cache.move_to_end(spec)
                return fut
            if self._pool is None:
                # NOTE: one thread: compiles are rare (once per schema) and the cores belong to the engine's steps
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
            fut = self._cache[spec] = self._pool.submit(self._compile, spec)
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, spec: StructuredOutputSpec) -> Any:
        if self._compiler is None:
            import xgrammar as xgr
            from tokenizers import Tokenizer as Backend
            from transformers import PreTrainedTokenizerFast

            # NOTE: as vLLM does, TokenizerInfo.from_huggingface: it reads the vocabulary's encoding (byte-level,
            # byte-fallback, raw) from the tokenizer itself; ours is a `tokenizers` backend, wrapped for it.
            backend = Backend.from_str(json.loads(self._tokenizer.to_json())["tokenizer"])
            info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend),
                                                      vocab_size=self._vocab_size,
                                                      stop_token_ids=self._stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler.compile_grammar(build_grammar(spec))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


class StructuredOutputs:
    """An engine's structured-output side: compile off the loop, park sequences until ready, advance matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self._parked: dict[str, tuple[Seq, Callable[[Seq], None]]] = {}  # request id → (sequence, how to schedule)

    def admit(self, seq: Seq, schedule: Callable[[Seq], None]) -> None:
        """Schedule `seq` now if it has no grammar or its grammar is compiled; else park it until it is."""
        spec = seq.params.structured
        if spec is None:
            schedule(seq)
            return
        # NOTE: parked even when the grammar is cached: the engine's next step releases it before scheduling
        seq.grammar = GrammarState(self.compiler.compile(spec))
        self._parked[seq.request_id] = (seq, schedule)

    def release(self) -> list[Seq]:
        """Schedule the parked sequences whose grammar is ready; return those that cannot run (compile failed, or
        an emitted token the grammar rejects), already unparked."""
        failed = []
        for rid, (seq, schedule) in list(self._parked.items()):
            state = seq.grammar
            assert state is not None
            if not state.future.done():
                continue
            del self._parked[rid]
            try:
                ok = state.start(seq.output_token_ids)
            except Exception:  # noqa: BLE001 - a compile that failed here is the request's failure, not the engine's
                log.exception("grammar of %s could not be compiled", rid)
                ok = False
            if ok:
                schedule(seq)
            else:
                log.error("request %s: its output does not follow its grammar; aborting it", rid)
                failed.append(seq)
        return failed

    def wait(self, timeout: float) -> None:
        """Block until a parked sequence's grammar is ready (or `timeout` s): for an engine with nothing else to do."""
        futures = [seq.grammar.future for seq, _ in self._parked.values() if seq.grammar is not None]
        if futures:
            wait_futures(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def forget(self, seq: Seq) -> None:
        self._parked.pop(seq.request_id, None)

    @staticmethod
    def accept(seq: Seq, token: int) -> None:
        """Advance `seq`'s matcher by an appended token (nothing without a grammar)."""
        state = seq.grammar
        if state is not None and state.matcher is not None and not state.accept(token):
            log.error("request %s: token %d is not allowed by its grammar", seq.request_id, token)
