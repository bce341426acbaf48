"""Programmatic dependent launch (decoder_svc/model/pdl.py): off in Triton's interpreter and with
MMSERVE_PDL=0, and every kernel launched with `launch_options()` waits for its inputs in its body (a
kernel launched early that read before `wait_for_inputs()` could read what its input buffer held before
the kernel ahead of it wrote it; tests/gpu/test_decode_gemv_gpu.py runs the chain on a GPU)."""

from __future__ import annotations

import ast
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from decoder_svc.model import decode_gemv, pdl, stream_gemv  # noqa: E402
from decoder_svc.model.quant import triton_fp8  # noqa: E402


def _launched_with_pdl(module) -> set[str]:
    """Names of the kernels a module launches as `kernel[grid](..., **launch_options())`."""
    names = set()
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
            continue
        if any(k.arg is None and isinstance(k.value, ast.Call) and getattr(k.value.func, "id", "") ==
               "launch_options" for k in node.keywords):
            names.add(node.func.value.id)
    return names


def _jit_source(obj) -> str:
    while not inspect.isfunction(obj):  # autotune / heuristics / jit wrappers keep the kernel in .fn
        obj = obj.fn
    return inspect.getsource(obj)


@pytest.mark.parametrize("module", [decode_gemv, triton_fp8, stream_gemv],
                         ids=lambda m: m.__name__.split(".")[-1])
def test_every_kernel_launched_early_waits_for_its_inputs(module):
    launched = _launched_with_pdl(module)
    assert launched  # the one-row products are launched so
    for name in launched:
        src = _jit_source(getattr(module, name))
        body = src[src.index("):\n"):]
        assert "wait_for_inputs()" in body, name
        # Before the wait only weights are read: no store, and no activation (x) load.
        before = body[:body.index("wait_for_inputs()")]
        assert "tl.store" not in before and "gl.store" not in before, name
        assert "x_ptr" not in before.replace("x_ptrs = x_ptr", ""), name


def test_off_in_the_interpreter_and_by_environment(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not pdl.enabled() and pdl.launch_options() == {}
    assert bool(pdl.launch_options()) == pdl.PDL.value  # launches follow what the kernels compiled in
    pdl.enabled.cache_clear()
    monkeypatch.setenv(pdl.ENV, "0")
    try:
        assert not pdl.enabled()
    finally:
        pdl.enabled.cache_clear()
