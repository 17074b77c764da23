"""Tensor parallelism: one engine over n ranks (`EngineConfig.tensor_parallel_size`, vLLM's name), one process each.

1. `LLMEngine` builds rank 0's runner (`runner.TPModelRunner`), which shards the weights (`shard.py`, Megatron
   style), starts ranks 1 .. n-1 with their shards through the launcher it is given (`launch.py`: spawned
   processes by default; a cluster's worker hosts them in Ray actors), and joins the group with them (`group.py`:
   NCCL on CUDA for the activations, shared memory on the CPU (`shm_allreduce.py`; gloo for a tensor past its
   slots); a pipe per follower for the step messages (`step_channel.py`; gloo where there are no FIFOs));
2. each step, rank 0 schedules as a TP 1 engine does, broadcasts the step (`follower.StepMessage`: flat ids,
   per-sequence starts and counts, block tables) and runs its forward; every rank runs the same
   forward on its heads and MLP columns, with an all-reduce after each o and down projection;
3. every rank computes its vocabulary columns of the logits of the rows that sample (the LM head split by rows),
   gathered on rank 0 (`group.VocabParallelHead`), which alone samples; the followers wait for the next message
   (`follower.TPFollower`);
4. the KV hand-off sees one engine with the full model's KV heads (`LLMEngine.kv_layout`, as TP 1 has them), so
   prefill on TP a hands off to decode on TP b for any a, b: rank 0's `read_blocks` gathers each layer's heads
   from the ranks and `write_blocks` sends each rank its heads (`kv.py`, on a third group, beside the steps);
5. a rank that dies fails the group as a whole (`launch.TPGroupError`, naming the rank) at the next collective or
   KV read or write; `LLMEngine.close` stops the followers.

Choices (why):
- the step message is the step's lists of ints, pickled once and written to each follower's pipe
  (`TPGroup.broadcast_object`; a gloo broadcast costs ~0.2 ms of thread hand-offs and TCP per step, a pipe a
  write and a wake-up) before rank 0 builds its own metadata: followers rebuild theirs with the same host code
  meanwhile. Cheaper than the scheduler's sequences (prompts, sampling params, grammar state that followers never
  use) or the built metadata (a dozen tensors per step, backend specific, on the GPU under CUDA). Full block
  tables are sent each step; deltas are a later saving.
- the embedding is replicated: its lookup reads T rows, and a vocabulary split would cost an all-reduce of [T, d]
  per step for no compute saved.
- the LM head is split by vocabulary rows (vLLM's ParallelLMHead; a tied head's rows cut from the embedding): each
  rank computes and reads 1/n of it, then rank 0 gathers the [N, vocab/n] parts (the sampler, grammar masks,
  penalties and logprobs read full rows on rank 0 only, so a gather, not an all-gather). Replicated on rank 0 alone,
  a 70B model's head is 2.1 GB of bf16 read per step while the followers wait, and 2.1 GB less KV pool on every
  rank (the ranks take the smallest pool). The gather costs a collective per step that samples: through the shared
  memory's slots on the CPU, NCCL on CUDA.
- TP 1 takes none of this: `make_runner` returns the plain ModelRunner (no wrapper, no all-reduce, no copy).
"""

from engine.parallel.shard import check_tp, rank_config, shard_weights

__all__ = ["check_tp", "rank_config", "shard_weights"]
