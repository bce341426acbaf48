"""Programmatic dependent launch (common/kernels/pdl.py): off in Triton's interpreter and with
MMSERVE_PDL=0, and every kernel launched with `launch_options()` waits for its inputs in its body (a
kernel launched early that read before `wait_for_inputs()` could read what its input buffer held before
the kernel ahead of it wrote it; tests/gpu/test_decode_gemv_gpu.py runs the chain on a GPU). The products
read their weights before the wait; the small kernels of a layer (norms, activation, rotary, KV store,
attention, split merge) and a MoE layer's kernels read nothing before it (but a norm's weight) and
release their successor only after it."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from common.kernels import (  # noqa: E402
    attention,
    decode_gemv,
    elementwise,
    fp8_linear,
    fp8_split_k,
    fused_moe,
    kv_store,
    moe_align,
    moe_route,
    pdl,
    stream_gemv,
)

PRODUCTS = [decode_gemv, fp8_linear, fp8_split_k, stream_gemv]
SMALL_KERNELS = {elementwise: {"_rms_norm_kernel", "_gated_act_kernel", "_rotary_kernel",
                               "_gated_rms_norm_kernel", "_delta_gates_kernel", "_qk_norm_kernel"},
                 attention: {"_paged_attention_kernel", "_merge_splits_kernel"},
                 kv_store: {"_store_kv_kernel", "_rotary_store_kv_kernel"},
                 # a MoE layer's kernels read nothing before the wait (the experts a product streams are
                 # the sort's output)
                 fused_moe: {"_grouped_gemm_kernel", "_combine_kernel"},
                 moe_align: {"_align_kernel", "_chunk_counts_kernel", "_place_kernel"},
                 moe_route: {"_route_kernel"}}


def _launched_with_pdl(module) -> set[str]:
    """Names of the kernels a module launches as `kernel[grid](..., **launch_options())` (or
    small_kernel_launch_options)."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
            continue
        if any(k.arg is None and isinstance(k.value, ast.Call) and getattr(k.value.func, "id", "") in
               ("launch_options", "small_kernel_launch_options") for k in node.keywords):
            names.add(node.func.value.id)
    return names


def _jit_source(obj) -> str:
    while not inspect.isfunction(obj):  # autotune / heuristics / jit wrappers keep the kernel in .fn
        obj = obj.fn
    return inspect.getsource(obj)


def _before_the_wait(module, name: str) -> str:
    src = _jit_source(getattr(module, name))
    body = src[src.index("):\n"):]
    assert "wait_for_inputs()" in body, name
    return body[:body.index("wait_for_inputs()")]


@pytest.mark.parametrize("module", PRODUCTS + list(SMALL_KERNELS), ids=lambda m: m.__name__.split(".")[-1])
def test_every_kernel_launched_early_waits_for_its_inputs(module):
    launched = _launched_with_pdl(module)
    assert launched  # the one-row products and the layer's small kernels are launched so
    for name in launched:
        before = _before_the_wait(module, name)
        # Before the wait only weights are read: no store, and no activation (x) load.
        assert "tl.store" not in before and "gl.store" not in before, name
        assert "x_ptr" not in before.replace("x_ptrs = x_ptr", ""), name


@pytest.mark.parametrize("module", list(SMALL_KERNELS), ids=lambda m: m.__name__.split(".")[-1])
def test_the_small_kernels_are_launched_early_and_read_nothing_before_the_wait(module):
    assert SMALL_KERNELS[module] <= _launched_with_pdl(module)
    for name in SMALL_KERNELS[module]:
        before = _before_the_wait(module, name)
        # Only a norm's weight (a parameter, never written) may be read before the wait.
        assert before.count("tl.load(") == before.count("tl.load(w_ptr"), name
        assert "release_dependents()" not in before, name


def test_off_in_the_interpreter_and_by_environment(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not pdl.enabled() and pdl.launch_options() == {}
    assert bool(pdl.launch_options()) == pdl.PDL.value  # launches follow what the kernels compiled in
    assert pdl.small_kernel_launch_options() == pdl.launch_options()
    pdl.enabled.cache_clear()
    pdl.small_kernel_launch_options.cache_clear()
    monkeypatch.setenv(pdl.ENV, "0")
    try:
        assert not pdl.enabled()
        monkeypatch.setenv(pdl.ENV, "products")
        assert pdl.small_kernel_launch_options() == {}
    finally:
        pdl.enabled.cache_clear()
        pdl.small_kernel_launch_options.cache_clear()


_COMPILE_SMALL = r"""
import json
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from common.kernels import pdl
pdl.PDL = tl.constexpr(True)  # as on an H200 (the kernels read it when compiled)
from common.kernels import attention as ta, kv_store as kv, elementwise as to

def ptx(kernel, types, constants, warps, **options):
    signature = {n: "constexpr" if n in constants else types.get(n, "*bf16" if n.endswith("_ptr") else "i32")
                 for n in kernel.arg_names}
    # What a launch specialises on: pointers and the strides / sizes of 7B shapes are multiples of 16.
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
               if n not in constants and n not in types and n not in ("eps", "half", "num_seqs", "window",
                                                                      "num_splits", "n_q_heads")}
    return triton.compile(ASTSource(kernel, signature, constants, aligned), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, **options}).asm["ptx"]

# The rotary launches' own compile options (RotaryLaunch.options(), at 7B shapes).
rot = to.RotaryLaunch.of(torch.empty(1, 32, 128), torch.empty(1, 8, 128), torch.zeros(1, dtype=torch.long),
                         torch.empty(16, 128))
rotary_options = {k: v for k, v in rot.options().items() if k != "num_warps"}
meta = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
        "query_start_loc_ptr": "*i32", "key_limits_ptr": "*i32", "scale_log2": "fp32"}
out = {
    "_rms_norm_kernel": ptx(to._rms_norm_kernel, {"eps": "fp32"},
                            {"HAS_RESIDUAL": True, "UNIT_OFFSET": False, "BLOCK": 4096}, 8),
    "_gated_act_kernel": ptx(to._gated_act_kernel, {}, {"GELU": False, "BLOCK": 256}, 2),
    "_rotary_store_kv_kernel": ptx(kv._rotary_store_kv_kernel,
                                   {"pos_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64"},
                                   {"KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_QH": 32, "BLOCK_KH": 8,
                                    "BLOCK_HALF": 64, "BLOCK_D": 128}, 8, **rotary_options),
    "_rotary_kernel": ptx(to._rotary_kernel, {"pos_ptr": "*i64", "cache_ptr": "*fp32"},
                          {"BLOCK_QH": 32, "BLOCK_KH": 8, "BLOCK_HALF": 64}, 8, **rotary_options),
    "_paged_attention_kernel": ptx(ta._paged_attention_kernel, meta,
                                   {"NUM_HEADS": 32, "H_PER_KV": 1, "HEAD_DIM": 128, "BLOCK_D": 128,
                                    "PAGE": 16, "BLOCK_M": 16, "BLOCK_Q": 16, "BLOCK_N": 64, "SPLIT": True,
                                    "IEEE": False, "HAS_WINDOW": False, "HAS_LIMITS": False,
                                    "DECODE": True, "ROTATE": False, "BLOCK_HALF": 1,
                                    "HEADS_FIRST": True}, 4),
    "_paged_attention_kernel, rotating a decode step": ptx(
        ta._paged_attention_kernel,
        {**meta, "positions_ptr": "*i64", "cos_sin_ptr": "*fp32", "slot_ptr": "*i64"},
        {"NUM_HEADS": 28, "H_PER_KV": 7, "HEAD_DIM": 128, "BLOCK_D": 128, "PAGE": 16, "BLOCK_M": 16,
         "BLOCK_Q": 2, "BLOCK_N": 64, "SPLIT": True, "IEEE": False, "HAS_WINDOW": False, "HAS_LIMITS": False,
         "DECODE": True, "ROTATE": True, "BLOCK_HALF": 64, "HEADS_FIRST": True}, 4, enable_fp_fusion=False),
    "_paged_attention_kernel, a mixed batch": ptx(
        ta._paged_attention_kernel, meta, {"NUM_HEADS": 28, "H_PER_KV": 7, "HEAD_DIM": 128, "BLOCK_D": 128,
                                           "PAGE": 16, "BLOCK_M": 64, "BLOCK_Q": 9, "BLOCK_N": 64,
                                           "SPLIT": False, "IEEE": False, "HAS_WINDOW": True,
                                           "HAS_LIMITS": True, "DECODE": False, "ROTATE": False,
                                           "BLOCK_HALF": 1, "HEADS_FIRST": True}, 4),
    "_merge_splits_kernel": ptx(ta._merge_splits_kernel, meta,
                                {"NUM_HEADS": 32, "HEAD_DIM": 128, "BLOCK_D": 128, "NUM_SPLITS": 8}, 4),
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def small_kernels_ptx() -> dict[str, str]:
    """Each small kernel compiled for sm_90 here (a child process: the session runs Triton's interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_SMALL], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: ptx[ptx.index("{"):] for name, ptx in json.loads(done.stdout.splitlines()[-1]).items()}


def test_the_small_kernels_compile_for_hopper_waiting_then_releasing(small_kernels_ptx):
    """Each small kernel waits for the one before, then lets the next one launch (one kernel queued behind
    the running one, pdl.py), and loads nothing from global memory before its wait but the norm's weight."""
    for name, body in small_kernels_ptx.items():
        release, wait = body.find("griddepcontrol.launch_dependents"), body.find("griddepcontrol.wait")
        assert 0 <= wait < release and "st.global" not in body[:wait], name
        loads_before = body[:wait].count("ld.global")
        assert loads_before == (2 if name == "_rms_norm_kernel" else 0), name  # 4096 bf16 / 256 threads


def test_the_rotary_kernels_round_each_product_as_hf_does(small_kernels_ptx):
    """HF rounds q*cos and rotate_half(q)*sin to the dtype before their sum; a contracted fma (a product
    and the sum rounded once) gives an ulp off where that rounding mattered. The rotary kernels multiply
    and add with separate rounded instructions (bf16: mul.rn.bf16 then sub / add.rn.bf16)."""
    rotating = "_paged_attention_kernel, rotating a decode step"
    for name in ("_rotary_kernel", "_rotary_store_kv_kernel", rotating):
        body = small_kernels_ptx[name]
        assert "fma" not in body, name
        assert "mul.rn.bf16" in body and "sub.rn.bf16" in body and "add.rn.bf16" in body, name


def test_the_rotary_kv_store_kernel_loads_in_two_rounds(small_kernels_ptx):
    """At one token a step the rotary + KV store kernel is latency: its only loads that wait on another load
    are cos/sin (on the position); no branch separates the loads, and every load precedes every store."""
    body = small_kernels_ptx["_rotary_store_kv_kernel"]
    loads = [i for i, line in enumerate(body.splitlines()) if "ld.global" in line]
    stores = [i for i, line in enumerate(body.splitlines()) if "st.global" in line]
    branches = [i for i, line in enumerate(body.splitlines()) if line.strip().startswith(("bra", "@%p")) and
                " bra " in f" {line.strip()} "]
    assert loads and stores and max(loads) < min(stores)
    assert not [b for b in branches if b < max(loads)]
    assert "ld.global.v" in body  # the head dim is contiguous: vector loads
