"""The adapters resident in one engine (at most `max_loras`), and the wrapping of the model's linears.

An adapter is loaded into a free slot and stays until unloaded (an adapter in use by a request cannot be). Each
(layer, linear) also has the slots' weights stacked, transposed as the batched matmuls read them, zeros past an
adapter's own rank, so a batched matmul or a kernel indexes a slot with no per-adapter shapes:
- for the Triton kernels, A.T [max_loras, in, R] and B.T [max_loras, R, out] (block-diagonal over a fused linear's
  parts), R the parts' ranks rounded up to a power of two (at least 16);
- on the CPU, A [max_loras, P * max_lora_rank, in] (part p's rows from p * max_lora_rank) and B.T in chunks
  [max_loras, C, max_lora_rank, W]: the linear's output cut into C chunks of W columns (the parts' widths' gcd), each
  chunk holding only its own part's rows (`chunks`: the part of each chunk).
NOTE: the block-diagonal B.T of q/k/v and gate/up is half to two thirds zeros; read per step by a decode batch's
expand, those zeros were about a third of the bytes (the cost, at decode sizes) of the LoRA work in a step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig, ModelConfig
from engine.errors import InvalidRequestError
from engine.lora.adapter import LINEARS, LoRAAdapter, LoRALoadError, LoRAPair, load_adapter, part_sizes
from engine.lora.batch import LoRALinear, LoRAStep
from engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


class LoRASlots:
    """Resident adapters by name and slot; `begin`/`end` bracket a step's forward pass."""

    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, kernel: bool = False,
                 share: Callable[[LoRAAdapter], LoRAAdapter] | None = None, shape: ModelConfig | None = None) -> None:
        """`cfg`: the model the adapters are read and checked against; `shape`: the architecture the wrapped linears
        compute (a TP rank's, engine/parallel/shard.py `rank_config`; default `cfg`), and `share` cuts a loaded
        adapter to it (engine/parallel/lora.py; default: whole)."""
        self.cfg, self.max_loras, self.max_rank, self.dtype, self.device = cfg, max_loras, max_rank, dtype, device
        self.share = share or (lambda adapter: adapter)
        # NOTE: the Triton kernels where the runner uses the Triton backend (CUDA; the interpreter on the CPU in tests)
        self.kernel = kernel
        self.by_name: dict[str, tuple[int, LoRAAdapter]] = {}
        self.free = list(range(max_loras - 1, -1, -1))  # NOTE: popped from the end: slot 0 first
        # NOTE: the one piece of per-step state: set by `begin` before the forward pass, read by every LoRALinear
        # (the model's call signature stays the base model's), cleared by `end`
        self.step: LoRAStep | None = None
        self._stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self.chunks: dict[str, torch.Tensor | None] = {}  # CPU: per linear, each output chunk's part (None: one part)
        for linear, parts in part_sizes(shape or cfg).items():
            width = math.gcd(*(o for o, _ in parts))
            owners = [p for p, (o, _) in enumerate(parts) for _ in range(o // width)]
            self.chunks[linear] = None if len(parts) == 1 else torch.tensor(owners, device=device)
            out, inp = sum(o for o, _ in parts), parts[0][1]
            for layer in range(cfg.num_layers):
                if kernel:
                    r = max(16, 1 << (len(parts) * max_rank - 1).bit_length())  # NOTE: tl.arange's power of two
                    b = torch.zeros(max_loras, r, out, dtype=dtype, device=device)
                    a = torch.zeros(max_loras, inp, r, dtype=dtype, device=device)
                else:
                    a = torch.zeros(max_loras, len(parts) * max_rank, inp, dtype=dtype, device=device)
                    b = torch.zeros(max_loras, len(owners), max_rank, width, dtype=dtype, device=device)
                self._stacks[(layer, linear)] = (a, b)

    @classmethod
    def around(cls, runner: ModelRunner, cfg: ModelConfig, engine_cfg: EngineConfig,
               share: Callable[[LoRAAdapter], LoRAAdapter] | None = None) -> LoRASlots:
        """`engine_cfg`'s adapter slots around `runner`'s linears (a TP rank's, cut by `share`: engine/parallel/lora.py
        `rank_share`); the adapters are read and checked against `cfg`, the whole model."""
        slots = cls(cfg, engine_cfg.max_loras, engine_cfg.max_lora_rank, engine_cfg.torch_dtype, runner.device,
                    kernel=runner.attn_backend == "triton", share=share, shape=runner.cfg)
        slots.wrap(runner.model.layers)
        return slots

    def wrap(self, layers: Sequence[object]) -> None:
        """Put a LoRALinear around each of the decoder layers' four linears (inside a TP rank's row-parallel
        wrapper, so its partial delta joins the layer's all-reduce: engine/parallel/lora.py)."""
        from engine.parallel.group import RowParallel

        for i, layer in enumerate(layers):
            for linear in LINEARS:
                base = getattr(layer, linear)
                if isinstance(base, RowParallel):
                    base.linear = LoRALinear(base.linear, self, i, linear)  # type: ignore[assignment]
                else:
                    setattr(layer, linear, LoRALinear(base, self, i, linear))

    def load(self, name: str, path: str) -> tuple[int, LoRAAdapter]:
        """Load and check the adapter at `path` into a free slot: its slot and the adapter as read (whole; the slot
        holds its `share`); LoRALoadError naming what is wrong."""
        if not isinstance(name, str) or not name:
            raise LoRALoadError("lora_name", "must be a non-empty string")
        if name in self.by_name:
            raise LoRALoadError("lora_name", f"an adapter named {name!r} is already loaded")
        if not self.free:
            raise LoRALoadError("max_loras", f"all {self.max_loras} adapter slots are taken "
                                             f"({sorted(self.by_name)}); unload one first")
        adapter = load_adapter(name, path, self.cfg, self.max_rank, self.dtype, self.device)
        slot = self.free[-1]
        self.install(name, slot, self.share(adapter))
        return slot, adapter

    def install(self, name: str, slot: int, adapter: LoRAAdapter) -> None:
        """Put an adapter already read and cut to this engine's linears into free `slot` (a TP follower: the share
        rank 0 sent it, into the slot rank 0 chose)."""
        self.free.remove(slot)
        self.by_name[name] = (slot, adapter)
        for (layer, linear), (a_stack, b_stack) in self._stacks.items():
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            pair = adapter.layers[layer].get(linear)
            if pair is not None and self.kernel:
                r = pair.a.shape[0]
                a_stack[slot, :, :r] = pair.a.T
                b_stack[slot, :r] = pair.b.T
            elif pair is not None:
                self._fill_chunks(pair, linear, a_stack[slot], b_stack[slot])

    def _fill_chunks(self, pair: LoRAPair, linear: str, a: torch.Tensor, b_c: torch.Tensor) -> None:
        """One slot of a CPU stack: a [P * max_rank, in] and b_c [C, max_rank, W] from the adapter's pair."""
        width, chunks = b_c.shape[2], self.chunks[linear]
        owners = [0] if chunks is None else chunks.tolist()
        row = 0
        for part, r in pair.ranks:
            a[part * self.max_rank: part * self.max_rank + r] = pair.a[row: row + r]
            for c, owner in enumerate(owners):
                if owner == part:
                    b_c[c, :r] = pair.b[c * width: (c + 1) * width, row: row + r].T
            row += r

    def unload(self, name: str, users: Sequence[str]) -> None:
        """Free an adapter's slot; refused (naming `lora_name`) while requests `users` run with it."""
        if name not in self.by_name:
            raise InvalidRequestError("lora_name", f"no adapter named {name!r} is loaded")
        if users:
            raise InvalidRequestError("lora_name", f"adapter {name!r} is in use by {len(users)} request(s) "
                                                   f"({sorted(users)[:4]}); unload it when they finish")
        slot, _ = self.by_name.pop(name)
        self.free.append(slot)

    def get(self, name: str, request_id: str | None = None) -> LoRAAdapter:
        """The loaded adapter `name`, or InvalidRequestError naming `lora`."""
        entry = self.by_name.get(name)
        if entry is None:
            raise InvalidRequestError("lora", f"no adapter named {name!r} is loaded (loaded: "
                                              f"{sorted(self.by_name)})", request_id)
        return entry[1]

    def keys(self) -> dict[str, str]:
        """The loaded adapters' block-hash keys by name."""
        return {name: adapter.key for name, (_, adapter) in self.by_name.items()}

    def names(self) -> list[str]:
        """The loaded adapters' names, in slot order."""
        return sorted(self.by_name, key=lambda n: self.by_name[n][0])

    def stacks(self, layer: int, linear: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The slots' stacked weights of one linear: A.T [S, in, R] and B.T [S, R, out] (kernels), or A
        [S, P * max_rank, in] and B.T in chunks [S, C, max_rank, W] (CPU)."""
        return self._stacks[(layer, linear)]

    def order(self, batch: ScheduledBatch) -> ScheduledBatch:
        """The batch with each adapter's rows together, in slot order, base rows last (single-token entries still
        first, as the runner expects), so a decode step's segments are slices (LoRAStep.span)."""
        if all(s.params.lora is None for s in batch.seqs):
            return batch
        last = self.max_loras

        def key(i: int) -> tuple[bool, int]:
            name = batch.seqs[i].params.lora
            return batch.num_new_tokens[i] != 1, last if name is None else self.by_name[name][0]

        order = sorted(range(len(batch.seqs)), key=key)
        return ScheduledBatch([batch.seqs[i] for i in order], [batch.num_new_tokens[i] for i in order])

    def begin(self, names: Sequence[str | None], counts: Sequence[int]) -> None:
        """Group this step's rows (per sequence: its adapter's name or None, its rows) for the wrapped linears."""
        self.step = None
        if any(n is not None for n in names):
            entries = [None if n is None else self.by_name[n] for n in names]
            self.step = LoRAStep([None if e is None else e[1] for e in entries],
                                 [-1 if e is None else e[0] for e in entries], counts, self.device, self.stacks,
                                 self.max_loras, self.kernel, self.chunks)

    def end(self) -> None:
        self.step = None


def slots_of(lora: LoRASlots | None) -> LoRASlots:
    """An engine's adapter slots; InvalidRequestError naming `max_loras` for an engine without any."""
    if lora is None:
        raise InvalidRequestError("max_loras", "is 0: this engine serves no LoRA adapters")
    return lora


def adapter_key(lora: LoRASlots | None, name: str | None, request_id: str) -> str:
    """The block-hash extra key of adapter `name` ("" for the base model); unknown names refused naming `lora`."""
    if name is None:
        return ""
    if lora is None:
        raise InvalidRequestError("lora", f"adapter {name!r} asked for, but this engine serves no adapters "
                                          "(max_loras is 0)", request_id)
    return lora.get(name, request_id).key
