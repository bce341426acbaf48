"""The batched LoRA product: the torch reference against a per-row loop, and the Triton kernels against
the reference (on a CPU host in Triton's interpreter, so shapes stay small)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from decoder_svc.model.lora.reference import lora_add_reference  # noqa: E402
from tests.lora.adapters import rounded_inner_product  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(slots: int, rank: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(slots * rank, k, generator=gen)
    b = torch.randn(n, slots * rank, generator=gen)
    a[:rank], b[:, :rank] = 0, 0  # slot 0: the base model
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def _per_row(y, x, a, b, slots, rank):
    out = y.clone().float()
    for t, s in enumerate(slots.tolist()):
        cols = slice(s * rank, (s + 1) * rank)
        out[t] += (x[t].float() @ a[cols].float().T) @ b[:, cols].float().T
    return out.to(y.dtype)


@pytest.mark.parametrize(("rows", "rank", "n", "k"), [(1, 4, 64, 64), (7, 12, 96, 80), (5, 3, 130, 33)])
def test_reference_is_each_rows_own_adapter(rows, rank, n, k):
    a, b = _weights(3, rank, n, k, torch.float32)
    x = torch.randn(rows, k, device=DEVICE)
    y = torch.randn(rows, n, device=DEVICE)
    slots = torch.randint(0, 3, (rows,), device=DEVICE)
    slots[0] = 0
    got = lora_add_reference(y, x, a, b, slots, rank)
    torch.testing.assert_close(got, _per_row(y, x, a, b, slots, rank), rtol=1e-5, atol=1e-4)
    assert torch.equal(got[0], y[0])  # slot 0 adds exactly nothing
    if rows > 1:  # the test can fail: another slot's weights give another row
        wrong = lora_add_reference(y, x, a, b, (slots + 1) % 3, rank)
        assert not torch.allclose(wrong, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "rank", "n", "k"), [
    (1, 4, 64, 64), (6, 12, 200, 96), (3, 5, 33, 300),
    (2, 40, 70, 700),  # two rank blocks, the input split in chunks that end mid-block
    (1, 300, 24, 80),  # a rank wider than the expand's block: two passes over B's row
    (70, 12, 50, 96),  # more rows than GATHER_MAX_ROWS: the stacked GEMMs
])
def test_triton_matches_reference(dtype, rows, rank, n, k):
    pytest.importorskip("triton")
    from common.kernels.lora import GATHER_MAX_ROWS, lora_add_triton

    a, b = _weights(4, rank, n, k, dtype, seed=rows)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    y = torch.randn(rows, n, device=DEVICE).to(dtype)
    slots = torch.arange(rows, device=DEVICE) % 4
    want = lora_add_reference(y, x, a, b, slots, rank)
    if rows > GATHER_MAX_ROWS:  # the stacked GEMMs round the inner product to x's dtype, as PEFT does
        want = rounded_inner_product(y, x, a, b, slots, rank)
    got = lora_add_triton(y.clone(), x, a, b, slots, rank)
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(got, want, **tol)
    assert torch.equal(got[slots == 0], y[slots == 0])  # base rows are left as they are


def test_wrapped_projection_is_the_same_with_either_ops():
    """A LoRALinear over a plain projection gives the same rows through TritonOps (its kernels; the
    interpreter on a CPU host) as through the torch reference ops."""
    pytest.importorskip("triton")
    from decoder_svc.model.kernel_dispatch import TritonOps
    from decoder_svc.model.lora import LoRALinear, LoRASlots
    from decoder_svc.model.ops import TorchOps

    base = torch.nn.Linear(48, 40, bias=True).to(DEVICE)
    a, b = _weights(3, 6, 40, 48, torch.float32, seed=9)
    slots = LoRASlots(2)  # adapters in slots 1 and 2
    x = torch.randn(5, 48, device=DEVICE)
    slots.bind(torch.tensor([2, 0, 1, 1, 2], device=DEVICE), 5)
    with torch.no_grad():
        ref = LoRALinear(base, a, b, 6, slots, TorchOps)(x)
        got = LoRALinear(base, a, b, 6, slots, TritonOps)(x)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ref[1], base(x[1]).detach())
