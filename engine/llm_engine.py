"""LLMEngine: requests in, tokens out, one `step()` at a time; plus the KV seam between engines.

Life of a request:
1. `add_request` validates and tokenizes it and queues a Sequence;
2. each `step()` lets the scheduler pick a batch (decode tokens + prefill chunks), the runner computes it,
   and sampled tokens are appended, detokenized and checked against the stop conditions;
3. a finished request frees its blocks (they stay in the prefix cache).
With `n` > 1, choices 1 .. n-1 (request ids `<id>-<i>`, seed + i) fork from the request once its prompt is computed:
they share its prompt's KV blocks, and copy the one holding the last prompt token (copy-on-write).
With `speculative_config`, step 2 starts by proposing draft tokens for each decoding sequence; the runner verifies
them and a step may append several tokens to a request, each through the same stop checks (engine/spec_decode.py).
The KV seam: on the sending side `watch_layers` reports each layer of a prompt's KV as soon as the forward pass
wrote it (`read_kv_layer` copies it out); on the receiving side the engine's `KVImporter` adopts a sequence
prefilled elsewhere: `reserve_kv` → `write_kv_blocks` (as blocks arrive) → `commit_kv`, and it decodes on.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

import torch

from engine.block_hash import cache_scope
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.inputs import InputProcessor
from engine.kv_export import KVLayout
from engine.kv_import import KVImporter, KVReservation
from engine.kv_seam import KVSeam
from engine.loader import LoadedModel
from engine.lora.adapters_api import LoRAAdapters
from engine.output import OutputProcessor, RequestOutput
from engine.parallel.launch import FollowerLauncher
from engine.parallel.runner import make_runner
from engine.pool_size import kv_cache_dtype, pool_size
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode import NgramProposer, propose_drafts
from engine.stats import EngineStats
from engine.step_budget import StepBudget
from engine.structured_output import StructuredOutputs


class LLMEngine(LoRAAdapters, KVSeam):
    """One model replica with its paged KV cache, scheduler and runner (plain class; workers wrap it)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, *,
                 launch_followers: FollowerLauncher | None = None) -> None:
        self.config = config = config or EngineConfig()
        torch.set_num_threads(config.threads)
        self.model_config = mcfg = loaded.config
        self.tokenizer = loaded.tokenizer
        kv_dtype = kv_cache_dtype(config)
        # NOTE: the scope names the KV dtype (int8 KV never mixes with float KV); weight quantization is not in it,
        # so a decode pool with int8 weights can take KV from a prefill pool without (the issue asks for that).
        self.scope = cache_scope(mcfg.model_id, str(kv_dtype).removeprefix("torch."))
        size = pool_size(mcfg, config)
        model_len = size.model_len
        # NOTE: TP > 1: rank 0's runner, which starts the group's other ranks (engine/parallel/) with
        # `launch_followers` (a cluster's Ray actors), else as processes of this machine
        self.runner = make_runner(mcfg, config, loaded.weights, size.num_blocks, model_len, max_blocks=size.usable,
                                  launcher=launch_followers)
        num_blocks = self.runner.num_blocks
        self.max_model_len = min(model_len, num_blocks * config.block_size)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.prefill_order, StepBudget.of(config))
        self.runner.capture_graphs()
        self._make_lora(mcfg)  # NOTE: engine/lora/adapters_api.py
        self.inputs = InputProcessor(self.tokenizer, mcfg.vocab_size, self.max_model_len, config.block_size,
                                     self.scope)
        self.outputs = OutputProcessor(self.tokenizer, mcfg.eos_token_ids, self.max_model_len)
        self.structured = StructuredOutputs(self.tokenizer, mcfg.vocab_size, mcfg.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}  # unfinished requests
        self._reserved: dict[str, KVReservation] = {}  # incoming KV: blocks reserved until commit_kv/abort
        self._layer_watchers: dict[str, Callable[[int], None]] = {}
        self._forks: dict[str, list[Sequence]] = {}  # n > 1: the other choices, until the prompt is computed
        # NOTE: the full model's KV heads, whatever this engine's TP size: a TP group reads and writes blocks in that
        # layout (engine/parallel/kv.py), so a peer of another TP size takes them as they are
        self.kv_layout = KVLayout(self.scope, str(kv_dtype).removeprefix("torch."), mcfg.num_layers,
                                  config.block_size, mcfg.num_kv_heads, mcfg.head_dim)
        self.kv_importer = KVImporter(self.block_manager, self.runner.write_blocks, self.kv_layout, kv_dtype,
                                      mcfg.vocab_size, self.max_model_len)
        spec = config.speculative_config
        self.proposer = NgramProposer(spec) if spec is not None else None
        self._spec_drafted = 0
        self._spec_accepted = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._computed_tokens = 0

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None, *,
                    output_token_ids: Seq[int] = (), sent_chars: int = 0) -> Sequence:
        """Validate, tokenize and queue a request; raises InvalidRequestError naming the bad field.

        `output_token_ids` resumes a request another engine started (a decode failover): the tokens it generated
        count as output (max_tokens, seeds, stop strings) and are recomputed like a preempted sequence's;
        `sent_chars` of their text already reached the client.
        """
        params = params or SamplingParams()
        params.validate()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        self._check_unused(request_id)
        seq, forks = self.inputs.sequences(request_id, prompt, params, self.lora_key(params.lora, request_id),
                                           output_token_ids)
        if forks:  # NOTE: choices 1 .. n-1 fork from this one once its prompt is computed (`_fork`)
            self._forks[request_id] = forks
        self.outputs.start(seq, sent_chars)
        self._seqs[request_id] = seq
        self.structured.admit(seq, self.scheduler.add)  # NOTE: parked until its grammar is compiled, if it has one
        return seq

    def warm_up(self) -> None:
        """Run one throwaway request of less than a block and undo its counters: a fresh process's first steps pay
        one-time costs (weight packing, allocator growth) that belong to no user's first token nor step-cost fit."""
        counters = self._prompt_tokens, self._cached_tokens, self._computed_tokens
        n = max(1, self.config.block_size // 2)  # NOTE: prompt + output within one block: nothing is cached
        self.add_request("pdcluster-warm-up", [i % self.model_config.vocab_size for i in range(1000, 1000 + n)],
                         SamplingParams(max_tokens=2, ignore_eos=True))
        while self.has_unfinished_requests():
            self.step()
        self._prompt_tokens, self._cached_tokens, self._computed_tokens = counters

    def tokenize(self, prompt: str | Seq[int], request_id: str | None = None) -> list[int]:
        """Token ids of a prompt (text or ids), checked against the vocabulary and the context length."""
        return self.inputs.tokenize(prompt, request_id)

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks; unknown ids are ignored.

        NOTE: a reservation is freed only once the writes into it in flight are done; later ones are dropped.
        """
        self._layer_watchers.pop(request_id, None)
        self._forks.pop(request_id, None)  # NOTE: choices not forked yet go with it; forked ones have their own id
        res = self._reserved.pop(request_id, None)
        seq = res.seq if res is not None else self._seqs.pop(request_id, None)
        if seq is None:
            return
        if res is not None:
            self.kv_importer.free(res)
        else:
            self.scheduler.remove(seq)
            self.structured.forget(seq)
            self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.outputs.forget(seq)

    def has_unfinished_requests(self) -> bool:
        """Whether a step has anything to do (paused requests wait for `resume_request`)."""
        return len(self._seqs) > len(self.scheduler.paused)

    def pause_request(self, request_id: str) -> bool:
        """Stop stepping a request whose consumer is not reading (its blocks are kept); False if not scheduled."""
        seq = self._seqs.get(request_id)
        return seq is not None and self.scheduler.pause(seq)

    def resume_request(self, request_id: str) -> None:
        """Step a paused request again (unknown or finished ids are ignored)."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.scheduler.resume(seq)

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for every request that got a new token (or finished)."""
        results = self._release_grammars() if self.structured.num_parked else []
        if self.proposer is not None:
            propose_drafts(self.proposer, self.scheduler.running, self.max_model_len)
        batch = self.scheduler.schedule()
        if not batch.seqs:
            self.structured.wait(0.01)  # NOTE: only grammars being compiled are left (no-op otherwise)
            return results
        if self.lora is not None:
            batch = self.lora.order(batch)
            self.lora.begin([s.params.lora for s in batch.seqs], batch.num_new_tokens)
        try:
            sampled = self.runner.execute(batch, self._layer_hook(batch), lookahead=self._same_next(batch))
        finally:
            if self.lora is not None:
                self.lora.end()
        self._computed_tokens += batch.num_tokens
        for seq, n, tokens in zip(batch.seqs, batch.num_new_tokens, sampled):
            drafted = len(seq.spec_token_ids)
            if drafted:  # NOTE: no new list per sequence per step when nothing was drafted (speculation off)
                seq.spec_token_ids = []
            seq.num_computed_tokens += n - drafted
            self.block_manager.register_full_blocks(seq)
            if not tokens:
                continue
            if seq.num_output_tokens == 0:
                self._prompt_tokens += seq.num_prompt_tokens
                self._cached_tokens += seq.num_cached_tokens
            out = self.outputs.append(seq, tokens, self.structured.accept)
            children = self._forks.pop(seq.request_id, None) if self._forks else None
            if children:
                self._fork(seq, children)
            if out.finished:
                self._finish(seq)
            elif drafted:
                # NOTE: accepted drafts keep their K/V; the rejected ones' slots are rolled back.
                self.block_manager.truncate(seq, len(seq) - 1)
                self.block_manager.register_full_blocks(seq)
            if drafted:
                self._spec_drafted += drafted
                self._spec_accepted += len(tokens) - 1
            results.append(out)
        return results

    def _same_next(self, batch: ScheduledBatch) -> bool:
        """Whether the next step is likely this batch one token on (a graphed decode step then launches it early:
        engine/step.py Lookahead, unless `decode_lookahead` is off): nothing waits or is parked, nothing is drafted,
        every running sequence is in it."""
        return (self.config.decode_lookahead and self.runner.graphs is not None and self.proposer is None
                and not self.scheduler.waiting and not self.structured.num_parked
                and len(self.scheduler.running) == len(batch.seqs))

    def _fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Start the other choices of `parent` (n > 1) on its prompt's KV: shared blocks, the last one copied.

        NOTE: each child recomputes only the last prompt token (in its own copy of that block) to sample its first
        token with its own seed; without a free block it queues like a new request and hits the prefix cache.
        """
        for child in children:
            cow = self.block_manager.fork(parent, child)
            self.outputs.start(child)
            self._seqs[child.request_id] = child
            if cow is None:
                self.structured.admit(child, self.scheduler.add)
                continue
            self.runner.copy_block(*cow)
            child.num_cached_tokens = child.num_computed_tokens
            self.structured.admit(child, self.scheduler.add_running)  # NOTE: its own matcher (a grammar's, if any)

    def _release_grammars(self) -> list[RequestOutput]:
        """Schedule the parked sequences whose grammar is compiled; one that cannot follow its grammar ends (abort)."""
        outs = []
        for seq in self.structured.release():
            del self._seqs[seq.request_id]
            self.block_manager.free(seq)
            self.outputs.forget(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            outs.append(RequestOutput(seq.request_id, [], "", True, "abort", seq.output_token_ids))
        return outs

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        del self._seqs[seq.request_id]
        self.block_manager.free(seq)

    # ---- the KV seam's engine side (the rest: engine/kv_seam.py) ---------------------------------------------
    def _adopt(self, seq: Sequence, sent_chars: int) -> Sequence:
        self.outputs.start(seq, sent_chars)
        self._seqs[seq.request_id] = seq
        self.structured.admit(seq, self.scheduler.add_running)
        return seq

    def _check_unused(self, request_id: str) -> None:
        if request_id in self._seqs or request_id in self._reserved:
            raise InvalidRequestError("request_id", "is already in use", request_id)

    def close(self) -> None:
        """Stop the engine's other processes (a TP group's followers); a closed TP engine takes no more steps."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    # ---- introspection ------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        pool = self.block_manager.pool
        return EngineStats(pool.num_blocks, pool.num_free_blocks, pool.num_cached_blocks,
                           len(self.scheduler.waiting), len(self.scheduler.running) + len(self.scheduler.paused),
                           len(self._reserved),
                           self._prompt_tokens, self._cached_tokens, self._computed_tokens,
                           self.scheduler.num_preemptions, self._spec_drafted, self._spec_accepted,
                           len(self.scheduler.paused))
