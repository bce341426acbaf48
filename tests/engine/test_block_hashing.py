"""Block identity without pickle (engine/block_hashing.py): every field that must count does, and the
identities are the same classes as the pickle hashing's (bench/block_hash.py keeps it as the baseline)."""

from __future__ import annotations

import itertools
import random

from bench.block_hash import packed_hashes, pickle_hashes
from decoder_svc.engine.block_hashing import extend_block_hashes
from decoder_svc.engine.block_manager import BlockManager
from decoder_svc.engine.request import ImagePlaceholder, Request
from decoder_svc.engine.sampling_params import SamplingParams

BS = 16
N_BLOCKS = 4


def _req(tokens: list[int] | None = None, images: tuple[tuple[str, int, int], ...] = (("h1", 20, 24),),
         salt: str = "", lora: str = "", rid: str = "r") -> Request:
    tokens = list(tokens) if tokens is not None else [100 + i for i in range(N_BLOCKS * BS + 1)]
    placeholders = [ImagePlaceholder(offset=o, length=n, content_hash=h) for h, o, n in images]
    return Request(rid, tokens, SamplingParams(), max_tokens=1, images=placeholders, cache_salt=salt,
                   lora_adapter=lora)


def _hashes(req: Request) -> list[bytes]:
    return packed_hashes(req, req.num_tokens // BS, BS)


def test_identical_inputs_give_identical_hashes():
    assert _hashes(_req()) == _hashes(_req(rid="other id"))
    assert len(set(_hashes(_req()))) == N_BLOCKS


def test_tokens_count():
    tokens = [100 + i for i in range(N_BLOCKS * BS + 1)]
    tokens[2 * BS + 3] += 1  # block 2
    a, b = _hashes(_req()), _hashes(_req(tokens))
    assert a[:2] == b[:2] and a[2] != b[2]


def test_parent_counts():
    # Block 0 differs, blocks 1.. have the same tokens and keys: only the parent tells them apart.
    tokens = [100 + i for i in range(N_BLOCKS * BS + 1)]
    tokens[0] = 7
    a, b = _hashes(_req(images=())), _hashes(_req(tokens, images=()))
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_image_content_hash_counts():
    a, b = _hashes(_req(images=(("h1", 20, 24),))), _hashes(_req(images=(("h2", 20, 24),)))
    assert a[0] == b[0] and a[1] != b[1]  # the image starts in block 1


def test_offset_within_the_image_counts():
    # The same tokens and image, placed 2 tokens earlier: block 2 holds other rows of the image.
    a, b = _hashes(_req(images=(("h1", 20, 24),))), _hashes(_req(images=(("h1", 18, 26),)))
    assert a[0] == b[0]
    assert a[2] != b[2]


def test_offset_within_a_block_counts_without_the_parent():
    # Two one-block prompts whose block holds the same image from another offset of the image: only
    # the image key's offset differs (the parent is the root for both).
    tokens = [4] * (BS + 1)
    a = _hashes(_req(tokens, images=(("h1", 0, 17),)))
    b = _hashes(_req(tokens, images=(("h1", -16, 33),)))  # the block starts 16 tokens into the image
    assert a[0] != b[0]


def test_image_overlap_counts():
    # An image ending exactly at a block's start does not enter that block; one token more does.
    a = _hashes(_req(images=(("h1", 20, 12),)))  # [20, 32)
    b = _hashes(_req(images=(("h1", 20, 13),)))  # [20, 33)
    assert a[1] == b[1] and a[2] != b[2]


def test_cache_salt_counts():
    a, b, c = _hashes(_req()), _hashes(_req(salt="tenant-1")), _hashes(_req(salt="tenant-2"))
    assert len({a[0], b[0], c[0]}) == 3


def test_lora_adapter_counts():
    a, b, c = _hashes(_req()), _hashes(_req(lora="vision")), _hashes(_req(lora="speech"))
    assert len({a[0], b[0], c[0]}) == 3


def test_salt_and_adapter_are_framed_apart():
    assert _hashes(_req(salt="x"))[0] != _hashes(_req(lora="x"))[0]
    assert _hashes(_req(salt="ab", lora="c"))[0] != _hashes(_req(salt="a", lora="bc"))[0]


def test_several_images_in_one_block_each_count():
    two = (("h1", 18, 4), ("h2", 24, 4))  # both in block 1
    assert _hashes(_req(images=two))[1] != _hashes(_req(images=(("h1", 18, 4), ("h3", 24, 4))))[1]
    assert _hashes(_req(images=two))[1] != _hashes(_req(images=(("h3", 18, 4), ("h2", 24, 4))))[1]


def test_hashes_extend_incrementally():
    req = _req(images=(("h1", 20, 30),), salt="s", lora="a")
    whole = _hashes(req)
    grown: list[bytes] = []
    for n in range(N_BLOCKS + 1):
        extend_block_hashes(grown, req, n, BS)
    assert grown == whole


def test_the_block_manager_uses_them():
    req = _req()
    assert BlockManager(8, BS).block_hashes(req) == _hashes(req)


def test_same_identity_classes_as_the_pickle_hashing():
    """Over random variants of every field: two blocks share a packed hash iff they shared a pickle one."""
    rng = random.Random(0)
    variants = []
    for _ in range(60):
        tokens = [100 + i for i in range(N_BLOCKS * BS + 1)]
        if rng.random() < 0.5:  # one token changed, in some block
            tokens[rng.randrange(len(tokens))] = 7
        offset = rng.choice((0, 5, 16, 20))
        length = rng.choice((4, 11, 12, 30))
        images = tuple((rng.choice(("h1", "h2")), offset + k * (length + 1), length)
                       for k in range(rng.choice((0, 1, 2))))
        variants.append(_req(tokens, images, salt=rng.choice(("", "s")), lora=rng.choice(("", "a"))))
    old = [pickle_hashes(v, N_BLOCKS, BS) for v in variants]
    new = [_hashes(v) for v in variants]
    pairs = 0
    for (o1, n1), (o2, n2) in itertools.combinations(zip(old, new, strict=True), 2):
        for b in range(N_BLOCKS):
            assert (o1[b] == o2[b]) == (n1[b] == n2[b])
            pairs += o1[b] == o2[b]
    assert pairs > 0  # some blocks were equal: the test compared both ways
