"""The Triton paged attention with a sliding window and with per-row key limits (Gemma 3's local layers and
bidirectional image blocks) equals the torch reference backend: mixed batches of decode rows and prefill
chunks over a cached prefix, windows smaller than a chunk, larger than the context and on tile and page
boundaries, images inside a chunk, at its start, across its start (a prefix hit that ended inside an
image), two in one chunk, GQA, and keys split among up to 16 programs (most of them empty for a window).

On a CPU host they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); tests/gpu
repeats them compiled, at real sizes.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from common.kernels.attention import paged_attention  # noqa: E402
from common.kernels.kv_store import store_kv  # noqa: E402
from decoder_svc.model.attention import AttentionMetadata, TorchAttentionBackend  # noqa: E402
from decoder_svc.model.kernel_dispatch import TritonAttentionBackend  # noqa: E402
from tests.engine.test_triton_attention import random_batch  # noqa: E402


def image_limits(seq_lens: list[int], query_lens: list[int],
                 images: dict[int, list[tuple[int, int]]], pad_rows: int = 0) -> torch.Tensor:
    """key_limits [tokens] for query rows: the last position of the image [start, end) a row's position
    lies in (images[i] lists sequence i's), else the row's own position; padded rows get 0."""
    limits = []
    for i, (n, nq) in enumerate(zip(seq_lens, query_lens, strict=True)):
        for pos in range(n - nq, n):
            last = pos
            for start, end in images.get(i, []):
                assert end <= n, "an image ends inside its sequence (the scheduler never splits one)"
                if start <= pos < end:
                    last = end - 1
            limits.append(last)
    return torch.tensor(limits + [0] * pad_rows, dtype=torch.int64)


def with_limits(meta: AttentionMetadata, limits: torch.Tensor | None) -> AttentionMetadata:
    if limits is not None:
        meta.key_limits = limits.to(meta.slot_mapping.device)
        meta.key_limits_cpu = limits
    return meta


def compare(seq_lens, query_lens, heads, kv_heads, dim, page, window, images=None, splits=(1, 4),
            seed=0, pad_seqs=0, tol=1e-4):
    """Triton (each split count) against the reference; returns the reference output."""
    q, k, v, kv_cache, meta = random_batch(seq_lens, query_lens, heads, kv_heads, dim, page, seed=seed,
                                           pad_seqs=pad_seqs)
    limits = None if images is None else image_limits(seq_lens, query_lens, images, pad_seqs)
    meta = with_limits(meta, limits)
    scale = dim ** -0.5
    ref_cache = kv_cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, scale, window=window)
    real = sum(query_lens)
    store_kv(k, v, kv_cache, meta.slot_mapping)
    assert torch.equal(kv_cache, ref_cache)
    for n in splits:
        out = torch.full_like(q, float("nan"))  # poison: every row must be written
        paged_attention(q, kv_cache, meta, scale, num_splits=n, out=out, window=window)
        assert torch.isfinite(out).all(), n
        torch.testing.assert_close(out[:real], ref[:real], rtol=tol, atol=tol,
                                   msg=lambda m, n=n: f"{n} splits: {m}")
        assert torch.equal(out[real:], torch.zeros_like(out[real:]))  # padded rows: nothing to see
    return ref


# Mixed batches: decode rows (two or more: the reference's batched decode path) and chunks over a prefix.
MIXED = [
    # seq_lens, query_lens, heads, kv_heads, dim, page
    ([200, 9, 130, 75], [40, 1, 1, 1], 8, 2, 16, 16),    # GQA 4: 16-token q-blocks, 64-key tiles
    ([150, 300], [150, 1], 4, 4, 16, 8),                   # a whole prompt and one long decode
    ([190, 66, 40], [70, 1, 33], 4, 1, 32, 16),           # GQA 4 over one KV head, two chunks
    ([120, 97], [25, 1], 2, 1, 160, 16),                  # head_dim > 128: 32-key tiles, padded head_dim
]


@pytest.mark.parametrize("case", MIXED, ids=[f"mixed{i}" for i in range(len(MIXED))])
@pytest.mark.parametrize("window", [1, 16, 64, 1000])
def test_window_equals_reference(case, window):
    """Windows of one key, of a page (16, smaller than the chunks), of a tile (64) and longer than every
    context (then equal to no window)."""
    ref = compare(*case, window=window, seed=window)
    if window == 1000:
        q, k, v, kv_cache, meta = random_batch(*case, seed=window)
        full = TorchAttentionBackend().forward(q, k, v, kv_cache, meta, case[4] ** -0.5)
        torch.testing.assert_close(ref, full)


# seq 0 is a 60-token chunk over a 140-token prefix (positions 140..199) next to decode rows.
IMAGE_SEQS, IMAGE_QUERIES = [200, 9, 130], [60, 1, 1]
IMAGES = {
    "middle": {0: [(150, 170)]},                # inside the chunk, across a 16-token q-block boundary
    "at_start": {0: [(140, 160)]},              # the chunk starts with an image
    "across_start": {0: [(120, 170)]},          # a prefix hit ended inside the image: the chunk's first
                                                # rows see the image's rest
    "two": {0: [(145, 155), (170, 190)]},       # two images in one chunk
    "at_end": {0: [(176, 200)]},                # the image ends the chunk (limit = seq_len - 1)
    "in_prefix": {0: [(10, 74)]},               # only cached rows are image: every query row is causal
}


@pytest.mark.parametrize("images", list(IMAGES), ids=list(IMAGES))
@pytest.mark.parametrize("window", [None, 8, 64])
def test_key_limits_equal_reference(images, window):
    """GQA 4 (16-token q-blocks); windows shorter than an image, and of one tile."""
    compare(IMAGE_SEQS, IMAGE_QUERIES, 8, 2, 16, 16, window, images=IMAGES[images],
            seed=len(images) + (window or 0))


def test_key_limits_many_splits_without_gqa():
    """No GQA (64-token q-blocks: one program holds the whole chunk), windows 63 and 128 (a tile less one,
    two tiles), 16 splits: most are empty for some rows."""
    for window in (None, 63, 128):
        compare(IMAGE_SEQS, IMAGE_QUERIES, 4, 4, 16, 16, window, images=IMAGES["two"], splits=(16,),
                seed=5)


def test_key_limits_whole_prompts_and_padding():
    """Two prompts in one batch (the second a full image then text), one decode row, CUDA-graph padding
    (seq_len 0, limit 0); head_dim 160 (32-key tiles)."""
    images = {0: [(3, 40), (64, 100)], 1: [(0, 33)]}
    for window in (None, 24):
        compare([110, 50, 17], [110, 50, 1], 4, 2, 160, 16, window, images=images, splits=(1, 8),
                pad_seqs=2)


def test_random_images_windows_and_splits():
    """Random chunks, images and windows (the images end inside their sequence, as the scheduler makes
    them); 3 query heads per KV head (tiles of 15 rows out of 16, 21 of 64)."""
    g = torch.Generator().manual_seed(7)
    for trial in range(5):
        seq_lens, query_lens, images = [], [], {}
        for i in range(int(torch.randint(1, 4, (1,), generator=g))):
            n = int(torch.randint(20, 220, (1,), generator=g))
            nq = 1 if i % 3 == 2 else int(torch.randint(2, n + 1, (1,), generator=g))
            spans, pos = [], int(torch.randint(0, 20, (1,), generator=g))
            while pos < n - 2:
                length = int(torch.randint(1, 40, (1,), generator=g))
                if nq > 1 and pos + length <= n:
                    spans.append((pos, pos + length))
                pos += length + int(torch.randint(1, 30, (1,), generator=g))
            seq_lens.append(n)
            query_lens.append(nq)
            images[i] = spans
        window = [None, 5, 16, 50, 100][trial % 5]
        compare(seq_lens, query_lens, 6, 2, 16, 8, window, images=images, splits=(1, 2), seed=trial)


def test_backend_masks_window_and_limits():
    """TritonAttentionBackend.forward (its own split count) takes both, and says so."""
    backend = TritonAttentionBackend(num_sms=64)
    assert backend.supports_sliding_window
    seq_lens, query_lens = [200, 9, 130], [60, 1, 1]
    q, k, v, kv_cache, meta = random_batch(seq_lens, query_lens, 8, 2, 16, 16, seed=3)
    meta = with_limits(meta, image_limits(seq_lens, query_lens, {0: [(120, 170)]}))
    assert backend.num_splits(q, kv_cache, meta) > 1
    ref = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), meta, 0.25, window=32)
    out = backend.forward(q, k, v, kv_cache, meta, 0.25, window=32)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_window_tiles_below_are_skipped():
    """Keys below every row's window are never read: poisoning them (NaN) changes nothing."""
    q, k, v, kv_cache, meta = random_batch([300, 250], [20, 1], 4, 2, 16, 16, seed=11)
    ref = TorchAttentionBackend().forward(q, k, v, kv_cache.clone(), meta, 0.25, window=40)
    store_kv(k, v, kv_cache, meta.slot_mapping)
    tables = meta.block_tables.cpu()
    # seq 0's first query sits at 280 (window start 241), seq 1's at 249 (start 210): the 64-key tiles
    # below 192 are skipped, so their pages (12 of 16 keys) may hold anything.
    for seq in (0, 1):
        kv_cache[:, tables[seq, :192 // 16].long()] = float("nan")
    for n in (1, 4):
        out = paged_attention(q, kv_cache, meta, 0.25, num_splits=n, window=40)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
