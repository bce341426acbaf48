"""The greedy argmax (decoder_svc/runner/argmax.py) against torch.argmax: ties, NaN, infinities, signed
zeros, chunk edges, bf16 and fp32 rows, strided rows. On a CPU host the kernels run in Triton's
interpreter (tests/conftest.py); tests/gpu/test_step_kernels_gpu.py runs them compiled."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from decoder_svc.runner.argmax import CHUNK, argmax_rows, triton_argmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _want(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().cpu().argmax(dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [7, CHUNK, CHUNK + 3, 3 * CHUNK - 1])
def test_random_rows_pick_torchs_token(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(5, vocab, generator=gen) * 4).to(dtype).to(DEVICE)
    got = triton_argmax(logits)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), _want(logits))


def test_the_order_is_torchs():
    """Ties and NaNs go to the lowest index, across chunks too; NaN beats +inf; -0.0 ties +0.0;
    negatives order by value; an all -inf row picks 0."""
    vocab = 2 * CHUNK + 5
    rows = torch.full((8, vocab), -1.0)
    rows[0, [3, CHUNK + 1]] = 5.0  # a tie across chunks: the first
    rows[1, [CHUNK + 2, 2 * CHUNK + 1]] = float("nan")
    rows[1, 0] = float("inf")  # NaN wins over +inf, and the first NaN
    rows[2] = -2.0
    rows[2, 4] = -0.0
    rows[2, 9] = 0.0  # equal to -0.0: the lower index
    rows[3] = -1.0 - torch.arange(vocab, dtype=torch.float32)  # all negative, falling
    rows[3, CHUNK + 7] = -0.5
    rows[4] = float("-inf")
    rows[5, -1] = float("inf")  # in the last, partial chunk
    rows[6] = -3e38
    rows[6, 2 * CHUNK] = -1e-45  # the smallest negative subnormal beats every other negative
    rows[7, CHUNK - 1] = float("-nan")  # a negative-signed NaN is still NaN
    want = _want(rows)
    assert want.tolist() == [3, CHUNK + 2, 4, CHUNK + 7, 0, vocab - 1, 2 * CHUNK, CHUNK - 1]
    for dtype in (torch.float32, torch.bfloat16):
        x = rows.to(dtype).to(DEVICE)
        assert torch.equal(triton_argmax(x).cpu(), _want(x)), dtype


def test_strided_rows_and_the_dispatch():
    """A row slice of a wider buffer (as the graph's logits are) is read in place; argmax_rows takes
    torch off CUDA and refuses what is not [rows, vocab]."""
    wide = torch.randn(4, 3 * CHUNK, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    part = wide[:3, :CHUNK + 9]
    assert torch.equal(triton_argmax(part).cpu(), _want(part))
    if DEVICE == "cpu":
        assert torch.equal(argmax_rows(part), part.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, 10, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="rows, vocab"):
        argmax_rows(torch.zeros(10))
