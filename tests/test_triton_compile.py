"""The Triton attention kernels and the layers' pointwise kernels (engine/triton_ops.py) compile for an H100 (sm_90)
on this CPU-only machine: Triton's compiler and the ptxas it ships take them to a cubin within an H100's shared
memory, so what the interpreter (tests/test_triton_attention.py) does not check holds: tile shapes and types the
NVIDIA backend takes (tl.dot's reduction dimension >= 16; the kernels pad every tl.dot dimension to >= 16 anyway),
shared memory per program.
bf16 as the engine runs on CUDA with Llama-3.1-8B's heads (32 query / 8 KV, head_dim 128), float32 with
input_precision="ieee" (the fp32 path's precision) with SmolLM2's group (9 / 3) at head_dim 128, the most shared
memory any of our models asks.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# NOTE: triton is imported only in the compiling process (compile_all): Triton's interpreter works only where triton
# was first imported with TRITON_INTERPRET=1, which the interpreted tests (test_triton_attention, test_triton_ops)
# see to; an import here, in the test process, would break them when this file runs first.
# NOTE: a GPU's shared memory per block (H100: 227 KiB); a kernel needing more fails to launch there.
MAX_SHARED = 227 * 1024


def _compile(kernel: object, pointers: dict[str, str], consts: dict[str, object]) -> int:
    """Compile `kernel` (its plain Python function: the module may be interpreted here) for H100; shared bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = JITFunction(getattr(kernel, "fn", kernel))
    sig = {a: "constexpr" if a in consts else pointers.get(a, "fp32" if a in ("scale", "eps") else "i32")
           for a in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))  # H100
    return int(compiled.metadata.shared)


def compile_all(dtype: str, precision: str, group: int, d: int) -> None:
    """Compile the kernels for H100 with `dtype` tiles, GQA `group` and head_dim `d` (run in a fresh process:
    see the test)."""
    # NOTE: imported here, in that process: imported by the test process, the modules would be the compiled ones
    # there, which the interpreted tests (test_triton_attention, test_triton_ops) must not find
    import triton

    import engine.attention.triton_kernels as tk
    import engine.triton_ops as ops

    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    tiles = dict(GROUP=group, HEAD_DIM=d, D_PAD=tk._pad(d), BLOCK_SIZE=16, UPCAST=False, PRECISION=precision)
    shared = _compile(tk._decode_kernel, {
        "q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}", "v_cache_ptr": f"*{dtype}", "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
    }, tiles | dict(GROUP_PAD=tk._pad(group), BLOCK_N=tk.DECODE_BLOCK_N, NUM_SPLITS=16))
    assert 0 < shared <= MAX_SHARED, shared
    shared = _compile(tk._prefill_kernel, {
        "q_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}", "v_cache_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
        "q_start_ptr": "*i32", "q_lens_ptr": "*i32", "ctx_lens_ptr": "*i32", "block_tables_ptr": "*i32",
    }, tiles | dict(zip(("BLOCK_M", "BLOCK_N"), tk.prefill_tiles(torch_dtype)),
                    BLOCK_Q=tk.prefill_tiles(torch_dtype)[0] // group))
    assert 0 < shared <= MAX_SHARED, shared
    _compile(tk._merge_kernel, {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "out_ptr": f"*{dtype}"},
             dict(NUM_SPLITS=3, S_PAD=4, HEAD_DIM=d, D_PAD=tk._pad(d)))
    _compile(tk._write_kernel, {"k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "k_cache_ptr": f"*{dtype}",
                                "v_cache_ptr": f"*{dtype}", "slot_ptr": "*i64"},
             dict(KV_HEADS=8, H_PAD=8, HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), BLOCK_SIZE=16))
    # the layers' pointwise kernels (engine/triton_ops.py) with Llama-3.1-8B's widths
    t = f"*{dtype}"
    _compile(ops._rms_norm_kernel, {"x_ptr": t, "delta_ptr": t, "res_ptr": t, "out_ptr": t, "w_ptr": t},
             dict(N=4096, BLOCK=4096, HAS_DELTA=True))
    _compile(ops._silu_mul_kernel, {"x_ptr": t, "out_ptr": t}, dict(F=14336, BLOCK=1024))
    _compile(ops._rotary_kernel, {"x_ptr": t, "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "v_ptr": t,
                                  "k_cache_ptr": t, "v_cache_ptr": t, "slot_ptr": "*i64"},
             dict(HEADS=40, H_PAD=64, HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2), Q_HEADS=32,
                  KV_HEADS=8, KV_PAD=8, BLOCK_SIZE=16))
    print("compiled")


@pytest.mark.parametrize("dtype,precision,group", [("bf16", "tf32", 4), ("fp32", "ieee", 3)])
def test_kernels_compile_for_an_h100(dtype, precision, group) -> None:
    # NOTE: in a fresh process: after interpreted launches (tests/test_triton_attention.py) triton.language is
    # left patched for the interpreter and the compiler fails on it.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from tests.test_triton_compile import compile_all; compile_all({dtype!r}, {precision!r}, {group}, 128)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
