"""The experts' GEMVs through TMA (common/kernels/moe_stream_gemv.py) without a GPU: off on the CPU, and
compiled for Hopper (sm_90) here, every config, bf16 and FP8 experts, both products, with the PTX checked
for what the kernel is for: weight tiles through TMA bulk copies, all of them after the wait (the expert is
the router's output), one wait a stage, no global load in the loop (the activation row is built in shared
memory first). tests/gpu/test_fused_moe_gpu.py runs it against the reference.

The compiles run in a child process, as tests/engine/test_stream_gemv.py's (Gluon does not compile under
the interpreter this session runs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from common.kernels import moe_stream_gemv  # noqa: E402
from common.kernels.moe_tuning import _agrees  # noqa: E402

_COMPILE = r'''
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from common.kernels import pdl
pdl.PDL = tl.constexpr(True)  # as on an H100 (the kernel reads it when compiled)
from common.kernels import moe_stream_gemv as ms
from common.kernels.stream_gemv import ROW_BYTES

out = {}
for dtype, bits in {"bf16": 16, "fp8e4nv": 8}.items():
    for c in ms.CONFIGS:
        for product, k in (("gate_up", 2048), ("down", 768)):
            block_k = ROW_BYTES * 8 // bits
            desc = (f"tensordesc<{dtype}[{c.block_n}, {block_k}],NVMMASharedLayout(swizzle_byte_width=0, "
                    f"element_bitwidth={bits}, rank=2, transposed=False, fp4_padded=False, cga_layout=[])>")
            signature = {"w_desc": desc, "a_ptr": "*bf16", "ids_ptr": "*i32", "weights_ptr": "*bf16",
                         "scale_ptr": "*fp32", "out_ptr": "*bf16", "N": "i32", "K": "i32",
                         "stride_am": "i32", "stride_om": "i32"}
            down = product == "down"
            constants = {"TOP_K": 8, "A_PER_TOKEN": not down, "A_SWIGLU": down, "MUL_WEIGHT": down,
                         "W_SCALED": bits == 8, "STAGES": c.stages, "VEC": 128 // bits,
                         "THREADS_K": ROW_BYTES // 16, "WARPS": c.warps, "K_TILES": triton.cdiv(k, block_k)}
            signature.update({name: "constexpr" for name in constants})
            attrs = {(i,): [["tt.divisibility", 16]] for i in (1, 2, 3, 4, 5)}
            kernel = triton.compile(GluonASTSource(ms._expert_stream_kernel, signature, constants, attrs),
                                    target=GPUTarget("cuda", 90, 32), options={"num_warps": c.warps})
            out[f"{c.name}-{dtype}-{product}"] = {"ptx": kernel.asm["ptx"], "shared": kernel.metadata.shared,
                                                  "ring": c.stages * c.block_n * ROW_BYTES}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_off_without_a_hopper_gpu():
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("a Hopper GPU is here")
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    gate_up, down = torch.zeros(4, 32, 64, dtype=torch.bfloat16), torch.zeros(4, 64, 16, dtype=torch.bfloat16)
    assert not moe_stream_gemv.usable(x, gate_up, down)


def test_every_config_is_named_once():
    assert len({c.name for c in moe_stream_gemv.CONFIGS}) == len(moe_stream_gemv.CONFIGS)


def test_compiles_for_hopper_streaming_the_expert_after_the_wait(compiled):
    assert len(compiled) == 2 * 2 * len(moe_stream_gemv.CONFIGS)
    for name, kernel in compiled.items():
        assert kernel["shared"] >= kernel["ring"], name
        ptx = kernel["ptx"]
        copies = [m.start() for m in re.finditer(r"cp\.async\.bulk\.tensor\.2d", ptx)]
        stages = int(re.search(r"st(\d+)w", name).group(1))
        assert len(copies) == stages + 1, name  # the ring's first round (unrolled) and the loop's refill
        assert ptx.count("mbarrier.try_wait") == 1, name
        assert min(copies) > ptx.index("griddepcontrol.wait"), name  # which expert is the router's output
        loop = ptx[ptx.index("mbarrier.try_wait"):ptx.index("griddepcontrol.launch_dependents")]
        assert "ld.global" not in loop, name


def test_a_candidate_must_compute_what_the_default_computes():
    reference = torch.randn(4, 64)
    assert _agrees(reference + 1e-4 * torch.randn(4, 64), reference)
    assert not _agrees(reference * 1.1, reference)
    assert not _agrees(torch.full((4, 64), float("nan")), reference)
