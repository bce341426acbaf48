"""The vision towers' GPU fast path, checked on a CPU: the Triton kernels of
common/kernels/vision_fused_ops.py
(run by Triton's interpreter, TRITON_INTERPRET=1, in a subprocess so that no other test's compiled
kernels are affected) against the eager steps, alone and wired into both Qwen towers; and the spans of
common/vision/attention.py against one attention call per span. The flash path itself needs CUDA:
tests/gpu/test_vision_fast_path_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.vision.attention import AttentionSpans

ROOT = Path(__file__).resolve().parents[2]

# Run under the interpreter: each kernel against the eager VisionOps, then each tiny tower with its
# fused ops against its eager ops (fp32; the interpreter's bfloat16 is not faithful, the GPU test covers it).
_SCRIPT = r"""
import json, sys
import numpy as np, torch
from PIL import Image
from common.kernels import vision_fused_ops as fused_ops
from common.families.qwen2_5_vl.tower import VisionOps
from common.families.qwen3_vl.tower import Qwen3VisionOps
from common.vision.encoders import make_vision_encoder
torch.manual_seed(0)
out = {}
for dtype in (torch.float32, torch.float16):
    n, heads, dim = 37, 3, 72
    qkv = torch.randn(n, 3, heads, dim).to(dtype)
    freqs = torch.randn(n, dim // 2)
    # both halves bit-equal, as the kernel reads only the first: cos() of a repeated tensor need not be
    # (a CI host's vectorized cos gave halves 3.7e-4 apart)
    cos, sin = freqs.cos().repeat(1, 2), freqs.sin().repeat(1, 2)
    got, want = fused_ops.rotary_qkv(qkv, cos, sin), VisionOps.rotary_qkv(qkv, cos, sin)
    out[f"rotary {dtype}"] = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
    assert all(g.is_contiguous() for g in got)
    x, d, w = torch.randn(n, 80).to(dtype), torch.randn(n, 80).to(dtype), torch.randn(80).to(dtype)
    got, want = fused_ops.add_rms_norm(x, d, w, 1e-6), VisionOps.add_rms_norm(x, d, w, 1e-6)
    out[f"add_rms_norm {dtype}"] = max((g.float() - r.float()).abs().max().item() for g, r in zip(got, want))
    out[f"rms_norm {dtype}"] = (fused_ops.add_rms_norm(x, None, w, 1e-6)[1].float()
                                - VisionOps.rms_norm(x, w, 1e-6).float()).abs().max().item()
    b = torch.randn(80).to(dtype)
    got = fused_ops.add_layer_norm(x, d, w, b, 1e-6)
    want = Qwen3VisionOps.add_layer_norm(x, d, w, b, 1e-6)
    out[f"add_layer_norm {dtype}"] = max((g.float() - r.float()).abs().max().item()
                                         for g, r in zip(got, want))
    gate_up = torch.randn(n, 200).to(dtype)
    out[f"silu_mul {dtype}"] = (fused_ops.silu_mul(gate_up).float()
                                - VisionOps.silu_mul(gate_up).float()).abs().max().item()
image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (150, 230, 3), dtype=np.uint8))
for name, model_dir in zip(("qwen2.5-vl", "qwen3-vl"), sys.argv[1:]):
    encoder = make_vision_encoder(model_dir)
    if hasattr(encoder.tower.blocks[0], "mlp") and hasattr(encoder.tower.blocks[0].mlp, "fuse"):
        for block in encoder.tower.blocks:  # the GPU's padded gate/up product, so silu_mul runs
            block.mlp.fuse()
    (eager,) = encoder.encode([image])
    encoder.tower.use_ops(encoder.eager_ops.fused())
    (fused,) = encoder.encode([image])
    out[f"tower {name}"] = ((fused - eager).norm() / eager.norm()).item()
print(json.dumps(out))
"""


def test_fused_kernels_and_towers_match_the_eager_steps(qwen_model_dir, qwen3_model_dir):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(qwen_model_dir), str(qwen3_model_dir)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    diffs = json.loads(done.stdout.strip().splitlines()[-1])
    for name, diff in diffs.items():
        if name.startswith("tower"):
            assert diff < 1e-5, (name, diff)  # fp32: rounding of rsqrt and of fused products only
        elif "float32" in name:
            assert diff <= 2e-6, (name, diff)
        else:
            assert diff <= 1e-3, (name, diff)  # fp16: an ulp where exp/rsqrt round differently
    assert len(diffs) == 12


_WIDE_SILU_MUL = r"""
import json, torch
from common.kernels import vision_fused_ops as fused_ops
from common.families.qwen2_5_vl.tower import VisionOps
torch.manual_seed(0)
gate_up = torch.randn(3, 2 * 2100)  # width 2100: three of the kernel's 1024-column blocks, the last partial
got, want = fused_ops.silu_mul(gate_up), VisionOps.silu_mul(gate_up)
print(json.dumps({"shape": list(got.shape), "diff": (got - want).abs().max().item(),
                  "columns_off": int((~torch.isclose(got, want, atol=1e-5)).any(0).sum())}))
"""


def test_silu_mul_covers_every_column_of_a_wide_product():
    """The kernel's grid spans every 1024-column block of the width (the towers' MLPs are several
    thousand wide; the check above is 100)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _WIDE_SILU_MUL], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["shape"] == [3, 2100]
    assert result["columns_off"] == 0 and result["diff"] <= 2e-6, result


@pytest.mark.parametrize("bounds", [[0, 5], [0, 3, 3, 10, 14, 21], [0, 64, 128, 150]])
def test_spans_attend_within_each_span_only(bounds):
    torch.manual_seed(0)
    n = bounds[-1]
    q, k, v = (torch.randn(n, 2, 8) for _ in range(3))
    spans = AttentionSpans.from_bounds(bounds, torch.device("cpu"), use_flash=False)
    assert spans.max_seqlen == int(np.diff(bounds).max())
    got = spans.attend(q, k, v, 0.3)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        want = F.scaled_dot_product_attention(qs, ks, vs, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(got[start:end], want, rtol=0, atol=1e-6)
