"""The TMA-streamed one-row product (common/kernels/stream_gemv.py) without a GPU: off on the CPU, and
compiled for Hopper (sm_90) here, every config and weight dtype, with the generated PTX checked for what
the kernel is for: weight tiles come through TMA bulk copies into a ring of shared memory; with
programmatic dependent launch every weight copy of the first round is issued before the wait and every
activation copy and load after it; no global load is left in the loop.
tests/gpu/test_stream_gemv_gpu.py runs it against the reference.

The compiles run in a child process: the test session runs Triton's interpreter (TRITON_INTERPRET=1),
under which Gluon cannot compile (its reductions' combine functions become interpreted ones)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from common.kernels import stream_gemv  # noqa: E402

DTYPES = {"fp8e4nv": 8, "bf16": 16}

_COMPILE = r'''
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from common.kernels import pdl
pdl.PDL = tl.constexpr(True)  # as on an H200 (the kernel reads it when compiled)
from common.kernels import stream_gemv as sg

out = {}
for dtype, bits in json.loads(sys.argv[1]).items():
    for c in sg.CONFIGS:
        block_k = sg.ROW_BYTES * 8 // bits
        desc = (f"tensordesc<{dtype}[{c.block_n}, {block_k}],NVMMASharedLayout(swizzle_byte_width=0, "
                f"element_bitwidth={bits}, rank=2, transposed=False, fp4_padded=False, cga_layout=[])>")
        x_desc = (f"tensordesc<bf16[{block_k}],NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, "
                  f"rank=1, transposed=False, fp4_padded=False, cga_layout=[])>")
        signature = {"w_desc": desc, "x_desc": x_desc, "scale_ptr": "*fp32", "bias_ptr": "*bf16",
                     "out_ptr": "*bf16", "N": "i32", "K": "i32", "W_SCALED": "constexpr",
                     "HAS_BIAS": "constexpr", "STAGES": "constexpr", "VEC": "constexpr",
                     "THREADS_K": "constexpr", "WARPS": "constexpr", "BOXES": "constexpr"}
        constants = {"W_SCALED": bits == 8, "HAS_BIAS": True, "STAGES": c.stages, "VEC": 128 // bits,
                     "THREADS_K": sg.ROW_BYTES // 16, "WARPS": c.warps, "BOXES": c.boxes}
        attrs = {(i,): [["tt.divisibility", 16]] for i in (2, 3, 4)}
        k = triton.compile(GluonASTSource(sg._stream_gemv_kernel, signature, constants, attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": c.warps})
        out[f"{c.name}-{dtype}"] = {"ptx": k.asm["ptx"], "shared": k.metadata.shared}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(DTYPES)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_off_without_a_hopper_gpu():
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("a Hopper GPU is here")
    assert not stream_gemv.available()
    x, w = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not stream_gemv.usable(x, w)


def test_every_config_fits_its_tile():
    assert all(c.fits() for c in stream_gemv.CONFIGS)
    assert len({c.name for c in stream_gemv.CONFIGS}) == len(stream_gemv.CONFIGS)


def test_two_tile_stages_take_weights_of_whole_stages_only():
    two = stream_gemv.StreamConfig(16, 4, 4, boxes=2)
    fp8 = torch.empty(16, 4096, dtype=torch.float8_e4m3fn)  # 16 tiles of 256 bytes
    assert two.takes(fp8) and two.takes(torch.empty(16, 11008, dtype=torch.bfloat16))  # 86 tiles
    assert not two.takes(torch.empty(16, 11008, dtype=torch.float8_e4m3fn))  # 43 tiles
    assert not two.takes(torch.empty(16, 4144, dtype=torch.float8_e4m3fn))  # 17 tiles, the last partial
    assert stream_gemv.StreamConfig(16, 4, 4).takes(torch.empty(16, 4144, dtype=torch.float8_e4m3fn))
    assert not stream_gemv.StreamConfig(16, 4, 4, boxes=3).fits()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("config", stream_gemv.CONFIGS, ids=lambda c: c.name)
def test_compiles_for_hopper_with_tma_copies_and_the_wait_between_weights_and_activations(
        compiled, config, dtype):
    kernel = compiled[f"{config.name}-{dtype}"]
    ring = config.stages * config.boxes * config.block_n * stream_gemv.ROW_BYTES
    assert kernel["shared"] >= ring
    ptx = kernel["ptx"]
    weights = [m.start() for m in re.finditer(r"cp\.async\.bulk\.tensor\.2d", ptx)]
    activations = [m.start() for m in re.finditer(r"cp\.async\.bulk\.tensor\.1d", ptx)]
    # The ring's first round (unrolled) and the loop's refill, of weights and of activations, a copy per
    # tile of a stage; one wait a stage.
    assert len(weights) == len(activations) == config.boxes * (config.stages + 1)
    assert ptx.count("mbarrier.try_wait") == 1
    wait = ptx.index("griddepcontrol.wait")
    assert all(c < wait for c in weights[:config.stages]) and min(activations) > wait
    loop = ptx[ptx.index("mbarrier.try_wait"):ptx.index("griddepcontrol.launch_dependents")]
    assert "ld.global" not in loop  # nothing in the loop waits on a global load
    assert min(m.start() for m in re.finditer(r"ld\.global", ptx)) > wait  # the scale and bias, at the end
