"""A KV block's identity: H(parent hash, token ids, extra keys), without pickle.

What makes two blocks' KV interchangeable, and so enters the hash:
- the parent block's hash (the root for block 0): the KV of a token depends on every token before it;
- the block's token ids;
- for every image (or video span) overlapping the block: its content hash and the offset of the block's
  first image token within it (the same tokens at another offset hold other rows of the embedding);
- in block 0 only: the request's cache salt and its LoRA adapter (KV computed under an adapter is its
  own), each when not empty.

The record is one buffer of framed fields: the parent's 32 bytes, the token count and the ids as int64,
then each extra key as a tag byte and a length-prefixed field, so distinct records never produce the same
buffer. Tokens are packed once per call, not once per block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from decoder_svc.engine.request import Request

ROOT_HASH = hashlib.sha256(b"mmserve.kv.v2").digest()  # block 0's parent

_TAG_SALT, _TAG_LORA, _TAG_IMAGE = b"S", b"L", b"I"


def _framed(tag: bytes, text: str) -> bytes:
    data = text.encode()
    return tag + len(data).to_bytes(4, "little") + data


def first_block_keys(cache_salt: str, lora_adapter: str) -> bytes:
    """Block 0's request-wide keys: the cache salt and the LoRA adapter, each only when set."""
    return ((_framed(_TAG_SALT, cache_salt) if cache_salt else b"")
            + (_framed(_TAG_LORA, lora_adapter) if lora_adapter else b""))


def image_key(framed_hash: bytes, offset_in_image: int) -> bytes:
    """One image's key in a block: its content hash (framed_image_hash) and the offset of the block's
    first image token within the image."""
    return framed_hash + offset_in_image.to_bytes(8, "little", signed=True)


def framed_image_hash(content_hash: str) -> bytes:
    """An image's content hash as its keys frame it (made once per image, not once per block)."""
    return _framed(_TAG_IMAGE, content_hash)


def hash_block(parent: bytes, token_bytes: bytes | memoryview, num_tokens: int, extra: bytes = b"") -> bytes:
    """The hash of one block: parent hash, its tokens packed as int64, and its extra keys' bytes."""
    return hashlib.sha256(b"".join((parent, num_tokens.to_bytes(4, "little"), token_bytes, extra))).digest()


def extend_block_hashes(hashes: list[bytes], request: Request, n_full: int, block_size: int) -> None:
    """Append the hashes of the request's blocks len(hashes)..n_full-1 to `hashes` (its earlier ones)."""
    first = len(hashes)
    if first >= n_full:
        return
    bs = block_size
    tokens = request.token_ids(first * bs, n_full * bs)
    packed = memoryview(struct.pack(f"<{len(tokens)}q", *tokens))  # one call, not one per block
    width = bs * 8
    count = bs.to_bytes(4, "little")
    images = sorted(request.images, key=lambda img: img.offset)
    framed = [framed_image_hash(img.content_hash) for img in images]
    offsets, ends = [img.offset for img in images], [img.end for img in images]
    n_images = len(images)
    head = first_block_keys(request.cache_salt, request.lora_adapter)
    sha256 = hashlib.sha256
    j = 0  # images before j end before the current block, so before every later one
    parent = hashes[-1] if hashes else ROOT_HASH
    row = 0
    for i in range(first, n_full):
        start = i * bs
        end = start + bs
        while j < n_images and ends[j] <= start:
            j += 1
        if j == n_images or offsets[j] >= end:  # a text block
            extra = b""
        elif j + 1 == n_images or offsets[j + 1] >= end:  # one image: inlined, the common case
            extra = framed[j] + max(start - offsets[j], 0).to_bytes(8, "little", signed=True)
        else:
            extra = _overlapping_keys(framed, offsets, ends, j, start, end)
        if i == 0:
            extra = head + extra
        # hash_block, inlined: this loop runs once per block of every admitted request
        parent = sha256(b"".join((parent, count, packed[row:row + width], extra))).digest()
        row += width
        hashes.append(parent)


def _overlapping_keys(framed: Sequence[bytes], offsets: Sequence[int], ends: Sequence[int], j: int,
                      start: int, end: int) -> bytes:
    """The keys of images j, j+1, ... that overlap [start, end), in offset order."""
    keys = b""
    while j < len(framed) and offsets[j] < end:
        if ends[j] > start:
            keys += framed[j] + max(start - offsets[j], 0).to_bytes(8, "little", signed=True)
        j += 1
    return keys
