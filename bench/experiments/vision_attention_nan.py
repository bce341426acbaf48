"""Where the Triton vision attention kernel's NaN comes from (seen on an H100, 2026-12-06: NaN in the head-dim
tail of the output for layouts with spans shorter than the key block; the failing tests moved between runs).

Every launch writes into an output poisoned beforehand (a value no attention output takes), so the table says,
per layout, head dim and variant, how many elements were left unwritten and how many were written but not
finite, and the error of the finite ones against an fp32 reference. Variants: the default tiles, one pipeline
stage, the 64-row tiles, and with and without the host's block map.

    python -m bench.experiments.vision_attention_nan          (CUDA only)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from bench.vision_attention import packed, window_lengths
from common.kernels import vision_attention as va

POISON = 7777.0
LAYOUTS = {
    "short": [0, 1, 2, 5, 17, 33, 100],
    "one_short": [0, 1],
    "exact64": [0, 64, 128],
    "under64": [0, 63, 126],
    "windows": list(packed(window_lengths(70), 1)),
    "uneven": [0, 64, 64, 128, 1353, 1417, 5513],
}


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """torch.empty inside the kernel's wrapper returns memory filled with POISON."""
    empty = torch.empty

    def filled(*args, **kwargs):
        out = empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(POISON)
        return out

    va.torch.empty = filled
    try:
        yield
    finally:
        va.torch.empty = empty


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int],
              scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    for a, b in zip(bounds, bounds[1:], strict=False):
        if b > a:
            s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
            out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:b])
    return out


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("CUDA only")
    cuda = torch.device("cuda")
    print(f"{'layout':10} {'hd':>3} {'variant':22} {'unwritten':>9} {'nonfinite':>9} {'bad dims':>10} "
          f"{'rel err':>9}")
    for name, bounds in LAYOUTS.items():
        for head_dim in (64, 72, 80, 96):
            gen = torch.Generator(cuda).manual_seed(head_dim)
            qkv = torch.randn(bounds[-1], 3, 16, head_dim, generator=gen, device=cuda)
            scale = head_dim**-0.5
            ref = reference(*qkv.unbind(1), bounds, scale)
            q, k, v = qkv.to(torch.bfloat16).unbind(1)
            cu = torch.tensor(bounds, dtype=torch.int32, device=cuda)
            max_len = int(np.diff(bounds).max())
            block_m = va.block_m_for(max_len)
            default = va.tiles_for(head_dim, block_m)
            variants = {
                "default+map": (default, True),
                "default, no map": (default, False),
                "one stage+map": (va.Tiles(default.block_m, default.block_n, default.num_warps, 1), True),
                "64x64 w4 s1+map": (va.Tiles(64, 64, 4, 1), True),
                "64x32 w4 s2+map": (va.Tiles(64, 32, 4, 2), True),
            }
            for label, (tiles, use_map) in variants.items():
                block_map = (torch.from_numpy(va.make_block_map(bounds, tiles.block_m)).to(cuda)
                             if use_map else None)
                with poisoned_outputs():
                    got = va.varlen_attention(q, k, v, cu, max_len, scale, block_map=block_map, tiles=tiles)
                torch.cuda.synchronize()
                got = got.float()
                unwritten = got == POISON
                nonfinite = ~torch.isfinite(got)
                bad = unwritten | nonfinite
                dims = bad.any(0).any(0).nonzero().flatten().tolist()
                dim_span = f"{dims[0]}-{dims[-1]}" if dims else "-"
                ok = ~bad
                err = ((got[ok] - ref[ok]).norm() / ref[ok].norm()).item() if ok.any() else float("nan")
                print(f"{name:10} {head_dim:>3} {label:22} {int(unwritten.sum()):>9} "
                      f"{int(nonfinite.sum()):>9} {dim_span:>10} {err:>9.2e}")


if __name__ == "__main__":
    main()
