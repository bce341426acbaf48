"""The rotary + KV store kernel (common/kernels/kv_store.py) against the two kernels it replaces
(TritonOps.rotary, then store_kv) and against the torch reference backend, on batches that mix prefill
chunks and decode rows with padded rows, GQA, strided q/k views of one fused qkv buffer, partial rotary
and one cos/sin row per token (M-RoPE's tables).

On a CPU host the kernels run in Triton's interpreter (tests/conftest.py); tests/gpu/test_ops_gpu.py
runs them compiled.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from common.kernels.kv_store import rotary_store_kv, store_kv  # noqa: E402
from decoder_svc.model.attention import TorchAttentionBackend  # noqa: E402
from decoder_svc.model.kernel_dispatch import (
    TritonAttentionBackend,  # noqa: E402
    TritonOps,  # noqa: E402
)
from decoder_svc.model.ops import TorchOps  # noqa: E402
from tests.engine.test_triton_attention import random_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v copied into one [T, (Hq + 2 Hk) * D] buffer and returned as strided views of it."""
    n, hq, d = q.shape
    hk = k.shape[1]
    buf = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], dim=1)
    return (buf, buf[:, :hq * d].view(n, hq, d), buf[:, hq * d:(hq + hk) * d].view(n, hk, d),
            buf[:, (hq + hk) * d:].view(n, hk, d))


def _table(width: int, positions: int, per_token: torch.Tensor | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, width, 2, device=DEVICE).float() / width))
    table = TorchOps.make_cos_sin_cache(inv_freq, positions)
    return table if per_token is None else table[per_token]  # M-RoPE: row i for token i


CASES = [
    # seq_lens, query_lens, heads, kv_heads, dim, page, rotary width, pad rows
    ([5, 1, 9, 13, 7], [1, 1, 3, 1, 1], 4, 2, 16, 4, 16, 0),  # decode rows around a chunk
    ([40, 17], [40, 5], 4, 4, 16, 16, 12, 0),                  # partial rotary (Phi-4-mini)
    ([70, 3], [20, 3], 8, 2, 32, 8, 32, 2),                     # GQA 4, CUDA-graph padding rows
    ([100], [1], 6, 2, 16, 16, 16, 3),                          # one decode, padded like a graph bucket
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True], ids=["positions", "per-token-rows"])
def test_one_kernel_writes_what_rotary_then_store_write(case, dtype, per_token):
    seq_lens, query_lens, heads, kv_heads, dim, page, width, pad = case
    q, k, v, kv_cache, meta = random_batch(seq_lens, query_lens, heads, kv_heads, dim, page, dtype=dtype,
                                           device=DEVICE, seed=width + pad, pad_seqs=pad)
    n = q.shape[0]
    positions = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).to(DEVICE)
    table = _table(width, 512, positions if per_token else None)
    if per_token:
        positions = torch.arange(n, device=DEVICE)

    buf, q1, k1, v1 = _fused(q, k, v)
    cache1 = kv_cache.clone()
    TritonOps.rotary(q1, k1, positions, table)
    store_kv(k1, v1, cache1, meta.slot_mapping)

    buf2, q2, k2, v2 = _fused(q, k, v)
    before = buf2.clone()
    cache2 = kv_cache.clone()
    rotary_store_kv(q2, k2, v2, positions, table, cache2, meta.slot_mapping)
    assert torch.equal(q2, q1)  # q rotated in place, the same bits
    assert torch.equal(cache2, cache1)  # the rotated keys and the values at the same slots, nothing else
    assert torch.equal(buf2[:, heads * dim:], before[:, heads * dim:])  # k and v left as they were
    if width < dim:  # partial rotary: the last dims of each key pass through
        real = meta.slot_mapping >= 0
        stored = cache2[0].view(-1, kv_heads, dim)[meta.slot_mapping[real]]
        assert torch.equal(stored[..., width:], k[real][..., width:])


@pytest.mark.parametrize("case", CASES[:3], ids=[f"case{i}" for i in range(3)])
def test_backend_rotates_stores_and_attends_as_the_reference(case):
    seq_lens, query_lens, heads, kv_heads, dim, page, width, pad = case
    q, k, v, kv_cache, meta = random_batch(seq_lens, query_lens, heads, kv_heads, dim, page, device=DEVICE,
                                           seed=7, pad_seqs=pad)
    positions = torch.tensor([p for n, nq in zip(seq_lens + [0] * pad, query_lens + [1] * pad, strict=True)
                              for p in range(max(n - nq, 0), max(n - nq, 0) + nq)], device=DEVICE)
    table = _table(width, 256)
    ref_cache = kv_cache.clone()
    want = TorchAttentionBackend().rotate_and_forward(q.clone(), k.clone(), v, TorchOps.rotary, positions,
                                                      table, ref_cache, meta, dim ** -0.5)
    cache = kv_cache.clone()
    got = TritonAttentionBackend(num_sms=64).rotate_and_forward(q.clone(), k.clone(), v, TritonOps.rotary,
                                                                positions, table, cache, meta, dim ** -0.5)
    real = sum(query_lens)
    torch.testing.assert_close(got[:real], want[:real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache, ref_cache, rtol=1e-5, atol=1e-5)


DECODE_CASES = [
    # seq_lens, heads, kv_heads, dim, page, pad rows, splits: decode-only batches (one row a sequence)
    ([5, 1, 9, 13, 7], 4, 2, 16, 4, 0, 1),
    ([100, 33], 8, 2, 32, 8, 2, 4),     # GQA 4, a graph's padding rows, split keys
    ([3], 6, 6, 16, 16, 3, 8),          # more splits than key tiles: some splits see no key
    ([65, 64, 2], 4, 1, 16, 16, 0, 2),  # the last key opens a tile, or ends one; MQA
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[f"case{i}" for i in range(len(DECODE_CASES))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_token", [False, True], ids=["positions", "per-token-rows"])
def test_decode_steps_rotate_and_store_inside_attention(case, dtype, per_token, monkeypatch):
    """A decode step's attention kernel rotates q in registers and has each sequence's last-key program
    rotate and store the new key and value (DecodeRotary): the cache gets the bits rotary_store_kv writes,
    the output is the separate launches' (and the torch reference's), q and k in memory stay as they were."""
    seq_lens, heads, kv_heads, dim, page, pad, splits = case
    q, k, v, kv_cache, meta = random_batch(seq_lens, [1] * len(seq_lens), heads, kv_heads, dim, page,
                                           dtype=dtype, device=DEVICE, seed=splits + pad, pad_seqs=pad)
    n = q.shape[0]
    positions = torch.tensor([max(s - 1, 0) for s in seq_lens] + [0] * pad, device=DEVICE)
    table = _table(dim, 256, positions if per_token else None)
    if per_token:
        positions = torch.arange(n, device=DEVICE)
    scale = dim ** -0.5
    fused_backend = TritonAttentionBackend(num_sms=64, rotate_in_attention=True)
    separate_backend = TritonAttentionBackend(num_sms=64, rotate_in_attention=False)
    monkeypatch.setattr(TritonAttentionBackend, "num_splits", lambda self, *a: splits)

    _, q1, k1, v1 = _fused(q, k, v)
    cache1 = kv_cache.clone()
    want = separate_backend.rotate_and_forward(q1, k1, v1, TritonOps.rotary, positions, table, cache1, meta,
                                               scale)
    buf2, q2, k2, v2 = _fused(q, k, v)
    before = buf2.clone()
    cache2 = kv_cache.clone()
    got = fused_backend.rotate_and_forward(q2, k2, v2, TritonOps.rotary, positions, table, cache2, meta,
                                           scale)
    assert torch.equal(cache2, cache1)  # the rotated keys and the values at their slots, nothing else
    assert torch.equal(buf2, before)  # q, k and v in memory as they were
    ref_cache = kv_cache.clone()
    ref = TorchAttentionBackend().rotate_and_forward(q.clone(), k.clone(), v, TorchOps.rotary, positions,
                                                     table, ref_cache, meta, scale)
    assert torch.equal(cache2, ref_cache)
    if dtype == torch.float32:  # the interpreter's bf16 tl.dot is no reference (tests/gpu checks bf16)
        real = len(seq_lens)
        assert torch.equal(got[:real], want[:real])
        torch.testing.assert_close(got[:real], ref[:real], rtol=1e-4, atol=1e-4)


def test_rotary_in_attention_takes_decode_steps_of_full_rotary_only():
    """Partial rotary, chunks and key limits keep the separate rotary + store launch (the backend checks
    DecodeRotary.applies); paged_attention refuses the rest."""
    from common.kernels.attention import DecodeRotary, paged_attention
    from common.kernels.elementwise import RotaryLaunch

    q, k, v, kv_cache, meta = random_batch([9, 4], [1, 1], 4, 2, 16, 4, device=DEVICE)
    positions = torch.tensor([8, 3], device=DEVICE)
    assert DecodeRotary.applies(q, k, v, _table(16, 64), meta)
    assert not DecodeRotary.applies(q, k, v, _table(12, 64), meta)  # partial rotary
    chunk = random_batch([9, 4], [3, 1], 4, 2, 16, 4, device=DEVICE)
    assert not DecodeRotary.applies(*chunk[:3], _table(16, 64), chunk[4])
    wide = random_batch([9], [1], 2, 1, 24, 4, device=DEVICE)  # a head dim that is no power of two
    assert not DecodeRotary.applies(*wide[:3], _table(24, 64), wide[4])
    cq, ck, cv, ccache, cmeta = chunk
    bad = DecodeRotary(ck, cv, cmeta.slot_mapping, RotaryLaunch.of(cq, ck, torch.arange(4, device=DEVICE),
                                                                   _table(16, 64)))
    with pytest.raises(ValueError, match="decode steps"):
        paged_attention(cq, ccache, cmeta, 0.25, rotary=bad)
    partial = TritonAttentionBackend(num_sms=64).rotate_and_forward(
        q.clone(), k.clone(), v, TritonOps.rotary, positions, _table(12, 64), kv_cache.clone(), meta, 0.25)
    ref = TorchAttentionBackend().rotate_and_forward(q.clone(), k.clone(), v, TorchOps.rotary, positions,
                                                     _table(12, 64), kv_cache.clone(), meta, 0.25)
    torch.testing.assert_close(partial, ref, rtol=1e-4, atol=1e-4)


def test_bad_shapes_are_refused_before_the_launch():
    q, k, v, kv_cache, meta = random_batch([6], [2], 4, 2, 16, 4, device=DEVICE)
    positions, table = torch.arange(2, device=DEVICE), _table(16, 64)
    with pytest.raises(ValueError, match="k and v must match"):
        rotary_store_kv(q, k, v[:, :1], positions, table, kv_cache, meta.slot_mapping)
    with pytest.raises(ValueError, match="kv_cache"):
        rotary_store_kv(q, k, v, positions, table, kv_cache[:, :, :, :1], meta.slot_mapping)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_store_kv(q, k, v, positions, table, kv_cache, meta.slot_mapping[:1])
    with pytest.raises(ValueError, match="positions"):
        rotary_store_kv(q, k, v, positions[:1], table, kv_cache, meta.slot_mapping)
    empty = q[:0], k[:0], v[:0]
    rotary_store_kv(*empty, positions[:0], table, kv_cache, meta.slot_mapping[:0])  # nothing to do
