"""The packed causal convolution kernels (common/kernels/causal_conv.py), run in Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 on a CPU host), against a torch reference built here from the
codes' definition: each output row's K inputs gathered code by code, summed with the weights in fp32,
silu, rounded, q and k heads L2-normalised. Packed rows of several sequences (fresh ones from zeros, warm
ones from carried columns of slots out of order, some shorter than K - 1 tokens), x a row slice of a wider
tensor, the carried pool a strided view, channel counts off the block, fp32 and bf16; the conv windows'
gather; and the convention tied to torch's causal conv1d."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from common.kernels.causal_conv import gather_conv_windows_, packed_causal_conv_, supports  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs Triton's interpreter (a CPU host)")

TAPS = 4
EPS = 1e-6
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=8e-3, rtol=1.6e-2)}


def _codes(sequences: list[tuple[int | None, int, int]], positions: int, taps: int = TAPS) -> torch.Tensor:
    """Source codes [rows, positions] for sequences (slot or None for a fresh one, x row of the first
    token, tokens): token t's inputs from K - 1 before it on (the conv's K taps: up to the token itself;
    a window of K - 1: up to the one before it), those before the sequence from the slot's carried columns
    (oldest first) or zeros."""
    carry = taps - 1
    codes = []
    for slot, first, tokens in sequences:
        for t in range(tokens):
            row = []
            for j in range(positions):
                i = t - carry + j  # the input's index in the sequence (< 0: before its first token)
                if i >= 0:
                    row.append(first + i)
                elif slot is None:
                    row.append(-1)
                else:
                    row.append(-(slot * carry + carry + i) - 2)
            codes.append(row)
    return torch.tensor(codes, dtype=torch.int32)


def _input(code: int, x: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
    carry = carried.shape[-1]
    if code >= 0:
        return x[code].float()
    if code == -1:
        return torch.zeros(x.shape[1])
    return carried[(-code - 2) // carry, :, (-code - 2) % carry].float()


def _reference_conv(x, sources, carried, weight, dtype, normalize_channels=0, head_dim=0) -> torch.Tensor:
    inputs = torch.stack([torch.stack([_input(int(code), x, carried) for code in row]) for row in sources])
    acc = (inputs * weight.float().t()[None]).sum(1)  # [P, K, C] -> [P, C]
    y = F.silu(acc).to(dtype)
    if normalize_channels:
        heads = y[:, :normalize_channels].float().reshape(y.shape[0], -1, head_dim)
        heads = heads * torch.rsqrt(heads.square().sum(-1, keepdim=True) + EPS)
        y[:, :normalize_channels] = heads.reshape(y.shape[0], -1).to(dtype)
    return y


def _reference_windows(x, sources, carried) -> torch.Tensor:
    return torch.stack([torch.stack([_input(int(code), x, carried) for code in row], dim=-1)
                        for row in sources]).to(carried.dtype)


def _setup(channels: int, dtype: torch.dtype, seed: int = 0):
    """x: a row slice of a wider tensor; carried: pool[2:7] of a pool laid out [S, K - 1, C] in memory."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(60, channels + 37, generator=gen).to(dtype)
    x = wide[:, 5:5 + channels]
    pool = torch.randn(9, TAPS - 1, channels, generator=gen).to(dtype).permute(0, 2, 1)
    carried = pool[2:7]
    weight = (torch.randn(channels, TAPS, generator=gen) * 0.5).to(dtype)
    return x, carried, weight


# Fresh sequences of 6 and 2 tokens (zeros before them), warm ones of 1, 2, 30 and 4 tokens from slots 4,
# 0, 3 and 2 (out of order), 45 rows in all (two row blocks of 32); x rows not in packed order.
SEQUENCES = [(None, 40, 6), (4, 3, 1), (0, 10, 2), (None, 50, 2), (3, 12, 30), (2, 0, 4)]


def _out(rows: int, channels: int, dtype: torch.dtype) -> torch.Tensor:
    """A row slice of a wider tensor, NaN-filled."""
    return torch.full((rows, channels + 9), float("nan"), dtype=dtype)[:, 3:3 + channels]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_conv_equals_the_reference(dtype):
    channels = 200  # two channel blocks of 128, the second part masked
    x, carried, weight = _setup(channels, dtype)
    sources = _codes(SEQUENCES, TAPS)
    out = _out(sources.shape[0], channels, dtype)
    packed_causal_conv_(x, sources, carried, weight, out)
    expected = _reference_conv(x, sources, carried, weight, dtype)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    # the mutant: taps in the other order gives other outputs, so the check above would catch it
    reversed_taps = _reference_conv(x, sources, carried, weight.flip(1), dtype)
    assert (reversed_taps.float() - out.float()).abs().max() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_and_k_heads_normalised_v_left(dtype):
    head_dim, normalize_channels, channels = 16, 64, 136  # q, k: 2 heads of 16 each; v: 72 channels
    x, carried, weight = _setup(channels, dtype, seed=1)
    sources = _codes(SEQUENCES, TAPS)
    out = _out(sources.shape[0], channels, dtype)
    packed_causal_conv_(x, sources, carried, weight, out, normalize_channels=normalize_channels,
                        head_dim=head_dim, eps=EPS)
    expected = _reference_conv(x, sources, carried, weight, dtype, normalize_channels, head_dim)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    norms = out[:, :normalize_channels].float().reshape(out.shape[0], -1, head_dim).norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), atol=2e-2, rtol=0)

    plain = _out(sources.shape[0], channels, dtype)
    packed_causal_conv_(x, sources, carried, weight, plain)
    assert torch.equal(out[:, normalize_channels:], plain[:, normalize_channels:])  # v: silu only
    assert not torch.allclose(out[:, :normalize_channels].float(), plain[:, :normalize_channels].float())


@pytest.mark.parametrize("key_heads", [2, 3])
@pytest.mark.parametrize("groups", [1, 3])
def test_split_outputs_take_q_k_v_apart_and_repeat_key_heads(groups, key_heads):
    """out = (q, k, v): the same values as one [P, C] output, each part in its own tensor (row slices of
    wider ones), q's and k's key heads each written to `groups` consecutive heads. Blocks of two heads
    (key_heads 2) and of one (3); a third row block with no carried input (a long fresh sequence)."""
    head_dim, dtype = 16, torch.bfloat16
    normalize_channels, channels = 2 * key_heads * head_dim, 2 * key_heads * head_dim + 72
    x, carried, weight = _setup(channels, dtype, seed=2)
    sources = _codes([*SEQUENCES, (None, 0, 40)], TAPS)
    rows = sources.shape[0]
    whole = _out(rows, channels, dtype)
    packed_causal_conv_(x, sources, carried, weight, whole, normalize_channels=normalize_channels,
                        head_dim=head_dim, eps=EPS)
    expected = _reference_conv(x, sources, carried, weight, dtype, normalize_channels, head_dim)
    torch.testing.assert_close(whole, expected, **TOLERANCE[dtype])  # so the parts below are the reference's
    q, k = (_out(rows, key_heads * groups * head_dim, dtype).view(rows, -1, head_dim) for _ in range(2))
    v = _out(rows, 72, dtype).view(rows, 4, 18)
    packed_causal_conv_(x, sources, carried, weight, (q, k, v), normalize_channels=normalize_channels,
                        head_dim=head_dim, eps=EPS)
    key = normalize_channels // 2
    want_q, want_k = (whole[:, lo:lo + key].reshape(rows, key_heads, head_dim) for lo in (0, key))
    assert torch.equal(q, want_q.repeat_interleave(groups, dim=1))
    assert torch.equal(k, want_k.repeat_interleave(groups, dim=1))
    assert torch.equal(v, whole[:, normalize_channels:].reshape(rows, 4, 18))
    with pytest.raises(ValueError, match="value channels"):
        packed_causal_conv_(x, sources, carried, weight, (q, k, v[:, :3]),
                            normalize_channels=normalize_channels, head_dim=head_dim)
    with pytest.raises(ValueError, match="need normalize_channels"):
        packed_causal_conv_(x, sources, carried, weight, (q, k, v))


@pytest.mark.parametrize("taps", [2, TAPS, 5])
def test_fresh_sequence_equals_torch_causal_conv1d(taps):
    """A fresh sequence's codes (zeros, then its rows): F.conv1d with K - 1 zeros of left padding."""
    channels, tokens = 40, 11
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(tokens, channels, generator=gen)
    weight = torch.randn(channels, taps, generator=gen)
    carried = torch.zeros(1, channels, taps - 1)
    out = torch.empty(tokens, channels)
    packed_causal_conv_(x, _codes([(None, 0, tokens)], taps, taps), carried, weight, out)
    conv = F.conv1d(x.t()[None], weight[:, None], padding=taps - 1, groups=channels)[0, :, :tokens]
    torch.testing.assert_close(out, F.silu(conv.t()), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_conv_windows(dtype):
    """The K - 1 inputs before each row of the sequences: the carried columns, zeros, x rows, or a mix."""
    channels = 150
    x, carried, _ = _setup(channels, dtype, seed=3)
    sources = _codes(SEQUENCES, TAPS - 1)[[6, 0, 2, 7, 8, 20, 44]]
    out = torch.full((sources.shape[0], channels, TAPS - 1), float("nan"), dtype=dtype)
    gather_conv_windows_(x, sources, carried, out)
    expected = _reference_windows(x, sources, carried)
    assert torch.equal(out, expected)
    assert not torch.equal(out, expected.flip(-1))  # the columns' order matters
    # before the warm 1-token sequence's token: its slot's carried columns, oldest first; before a
    # fresh sequence's first token: zeros
    assert torch.equal(out[0], carried[4])
    assert not out[1].any()


def test_conv_window_feeds_the_next_step():
    """Windows gathered after a step's pieces, used as the next step's carried inputs, give the outputs
    of the whole sequence convolved at once."""
    channels, tokens, split = 24, 9, 5
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, channels, generator=gen)
    weight = torch.randn(channels, TAPS, generator=gen)
    empty = torch.zeros(1, channels, TAPS - 1)
    whole = torch.empty(tokens, channels)
    packed_causal_conv_(x, _codes([(None, 0, tokens)], TAPS), empty, weight, whole)

    state = torch.empty(1, channels, TAPS - 1)
    window = _codes([(None, 0, split + 1)], TAPS - 1)[split:]  # the K - 1 inputs before token `split`
    gather_conv_windows_(x, window.contiguous(), empty, state)
    rest = torch.empty(tokens - split, channels)
    packed_causal_conv_(x, _codes([(0, split, tokens - split)], TAPS), state, weight, rest)
    torch.testing.assert_close(rest, whole[split:], atol=1e-6, rtol=0)


def test_supports():
    assert supports(8192, 4, 128)
    assert supports(200, 4, 0)
    assert not supports(8192, 4, 96)  # not a power of two
    assert not supports(8192, 9, 128)
    assert not supports(8192, 1, 128)
