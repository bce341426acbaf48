"""Where the Triton vision attention kernel's NaN comes from (seen on an H100, 2026-12-06: NaN in the head-dim
tail of the output for layouts with spans shorter than the key block; the failing tests moved between runs).

Every launch writes into an output poisoned beforehand (a value no attention output takes), so the table says,
per layout, head dim and variant, how many elements were left unwritten and how many were written but not
finite, and the error of the finite ones against an fp32 reference. Variants: the default tiles, one pipeline
stage, the 64-row tiles, and with and without the host's block map.

Two more columns test one reading of the first runs: the flash probe's errors (0.168 at head dim 72, 0.221 at
80, on [0, 32, 96]) are what a span's tail dims (64 on) give when they attend over its whole last key block,
the keys past the span included (0.166 and 0.222 on average in a CPU simulation). "tail err" is the error of
the tail dims of the spans that end in a partial key block; "vs block" the same against that wrong reference:
near 0 there (and not in "tail err") confirms it. Layout "probe" is the flash probe's, with q, k, v contiguous
as it makes them.

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
    "probe": [0, 32, 96],  # common/vision/attention.py's flash probe
}
SEPARATE = {"probe"}  # q, k, v contiguous tensors, not views of one qkv product


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


def block_end_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float,
                        block_n: int) -> torch.Tensor:
    """Each span's queries over the keys up to the end of its last key block (the wrong result a lost key
    mask gives), fp32."""
    out = torch.empty_like(q)
    for a, b in zip(bounds, bounds[1:], strict=False):
        if b > a:
            end = min(a + -(-(b - a) // block_n) * block_n, q.shape[0])
            s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:end]) * scale
            out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:end])
    return out


def partial_rows(bounds: list[int], block_n: int) -> torch.Tensor:
    """The rows of the spans whose length is not a multiple of block_n."""
    rows = [torch.arange(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if (b - a) % block_n]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item() if b.numel() and b.norm() > 0 else float("nan")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("CUDA only")
    cuda = torch.device("cuda")
    print(f"{'layout':10} {'hd':>3} {'variant':22} {'unwritten':>9} {'nonfinite':>9} {'bad dims':>10} "
          f"{'rel err':>9} {'tail err':>9} {'vs block':>9}")
    for name, bounds in LAYOUTS.items():
        for head_dim in (64, 72, 80, 96):
            gen = torch.Generator(cuda).manual_seed(head_dim)
            qkv = torch.randn(bounds[-1], 3, 16, head_dim, generator=gen, device=cuda)
            scale = head_dim**-0.5
            ref = reference(*qkv.unbind(1), bounds, scale)
            q, k, v = qkv.to(torch.bfloat16).unbind(1)
            if name in SEPARATE:
                q, k, v = (t.contiguous() for t in (q, k, v))
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
                rows = partial_rows(bounds, tiles.block_n).to(cuda)
                wrong = block_end_reference(*qkv.unbind(1), bounds, scale, tiles.block_n)
                tail_got = got[rows, :, 64:].nan_to_num(0.0)  # NaN are counted above; the rest compared here
                tail_err, vs_block = rel(tail_got, ref[rows, :, 64:]), rel(tail_got, wrong[rows, :, 64:])
                counts = f"{int(unwritten.sum()):>9} {int(nonfinite.sum()):>9}"
                print(f"{name:10} {head_dim:>3} {label:22} {counts} {dim_span:>10} {err:>9.2e} "
                      f"{tail_err:>9.2e} {vs_block:>9.2e}")


if __name__ == "__main__":
    main()
