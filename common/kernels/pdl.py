"""Programmatic dependent launch (Hopper and later): a decode product starts while the kernel before it ends.

A batch-1 decode step is some 300 kernels back to back in one CUDA graph; each boundary leaves the memory
system idle while the last programs of one kernel drain and the next one's first loads are in flight, and
a product of a few microseconds (a 4096 x 4096 FP8 weight streams in 4 us) loses a large share of its
time there. With PDL the product is launched early: its programs load their first weight tile (weights
are never written, so nothing can race on them), then `wait_for_inputs()` blocks until the kernel before
has finished and its writes are visible, and only then read activations or write anything. The kernels
before call `release_dependents()` (small kernels right after their own wait, products after their main
loop) so that the product's programs may take the SMs their own programs leave.

The small kernels of a layer (norms, activation, rotary + KV store, attention, split merge) are launched
early too: each waits first, reads nothing before the wait, then releases its successor. Their launch
and prologue then overlap the kernel before instead of following its end (some 200 boundaries a step).
Waiting before releasing keeps one kernel queued behind the running one: released first, a chain of
small kernels let a product three kernels ahead start streaming its weights during attention, and a
bf16 step lost 1.7% (H200, llava-1.5-7b: 244.7 against 249.0 tok/s with only the products early).

Only imported with triton (GPU paths, or TRITON_INTERPRET=1 where it is off). MMSERVE_PDL=0 turns it off
(the A/B of bench.fp8_gemv / bench.decode_tput), MMSERVE_PDL=products keeps it for the products only; it
is off below compute capability 9.0, where the griddepcontrol instructions do not exist.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENV = "MMSERVE_PDL"


@functools.cache
def enabled() -> bool:
    """Whether kernels are compiled and launched for programmatic dependent launch here."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1" or os.environ.get(ENV, "1") == "0":
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


PDL = tl.constexpr(enabled())


def launch_options() -> dict[str, bool]:
    """Keyword arguments for a kernel launch that waits with `wait_for_inputs()` before its reads.
    Follows the compiled-in PDL flag, never a later reading of the environment: a kernel launched early
    whose wait compiled to nothing would race."""
    return {"launch_pdl": True} if PDL.value else {}


@functools.cache
def small_kernel_launch_options() -> dict[str, bool]:
    """launch_options() for the layer's small kernels. MMSERVE_PDL=products launches only the products
    early (the small kernels' waits then return at once): the A/B of bench.profile_step."""
    return {} if os.environ.get(ENV, "1") == "products" else launch_options()


@triton.jit
def wait_for_inputs():
    """Block until the kernel before has finished and its writes are visible (no-op without PDL).
    A kernel launched with `launch_options()` calls it in every program before reading anything but its
    weights and before writing anything."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependents():
    """Let the next kernel, if launched with PDL, start its programs now (no-op without PDL)."""
    if PDL:
        gdc_launch_dependents()
