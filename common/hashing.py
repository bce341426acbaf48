"""Content hash of an image: the key of the embedding cache and of image-aware prefix reuse.

The hash covers everything that changes the embedding: the model (its fingerprint: config.json, every
processor setting and the weights, with the image's own settings such as Qwen-VL's pixel range), the
tenant's cache salt, and the image. An encoded file (what the services receive) is hashed as its bytes,
which fix its pixels: both services name it without decoding it, so a repeated image is never decoded
just to learn its name, and a new one is decoded once, by the encoder that embeds it (two encodings of
one picture are two entries). A decoded image given in-process (a PIL image) is hashed as its pixels
(mode, width, height, raw bytes). Every field is framed with a tag and its length, so two different
records can never concatenate to the same byte stream (vLLM #54283 came from unframed concatenation).
"""

from __future__ import annotations

import hashlib
import struct

from PIL import Image

try:  # blake3 is faster; sha256 keeps the hash available where the wheel is missing.
    from blake3 import blake3 as _blake3
except ImportError:  # pragma: no cover - exercised only without blake3
    _blake3 = None

DIGEST_SIZE = 32
_DOMAIN = b"mmserve.image.v1"
_FILE_DOMAIN = b"mmserve.image-file.v1"


# The longest cache_salt either service takes, in UTF-8 bytes: a tenant key, not a payload (it is hashed
# with every image and stored with every cache entry).
MAX_CACHE_SALT_BYTES = 256


def check_cache_salt(salt: str) -> str | None:
    """Why `salt` is refused (a message for the client), or None when it is fine."""
    size = len(salt.encode())
    if size > MAX_CACHE_SALT_BYTES:
        return f"cache_salt is {size} bytes; the limit is {MAX_CACHE_SALT_BYTES}"
    return None


_THREADED_BYTES = 1 << 20  # blake3 hashes inputs this large on several threads (a 3 MB file: ~4x on 16 cores)


def _hasher(size: int = 0):
    if _blake3 is None:
        return hashlib.sha256()
    return _blake3(max_threads=_blake3.AUTO) if size >= _THREADED_BYTES else _blake3()


def hash_algorithm() -> str:
    """The name of the hash function in use ("blake3" or "sha256")."""
    return "blake3" if _blake3 is not None else "sha256"


def _frame(hasher, tag: bytes, value: bytes | memoryview) -> None:
    hasher.update(struct.pack("<B", len(tag)) + tag + struct.pack("<Q", len(value)))
    hasher.update(value)


def framed_digest(domain: bytes, fields: list[tuple[bytes, bytes | memoryview]]) -> bytes:
    """32-byte digest of domain, then each (tag, value) framed with its length (no value is copied)."""
    h = _hasher(sum(len(value) for _, value in fields))
    h.update(domain)
    for tag, value in fields:
        _frame(h, tag, value)
    return h.digest()[:DIGEST_SIZE]


def image_content_hash(
    model_fingerprint: str,
    cache_salt: str,
    mode: str,
    width: int,
    height: int,
    pixels: bytes | memoryview,
) -> bytes:
    """32-byte digest of a framed record of (model, salt, mode, size, pixels)."""
    h = _hasher()
    h.update(_DOMAIN)
    _frame(h, b"model", model_fingerprint.encode())
    _frame(h, b"salt", cache_salt.encode())
    _frame(h, b"mode", mode.encode())
    _frame(h, b"size", struct.pack("<QQ", width, height))
    _frame(h, b"pixels", bytes(pixels))
    return h.digest()[:DIGEST_SIZE]


def hash_image(image: Image.Image, model_fingerprint: str, cache_salt: str = "") -> str:
    """Hex content hash of a decoded PIL image (the wire form)."""
    return image_content_hash(
        model_fingerprint, cache_salt, image.mode, image.width, image.height, image.tobytes()
    ).hex()


def hash_image_file(data: bytes | memoryview, model_fingerprint: str, cache_salt: str = "") -> str:
    """Hex content hash of an encoded image file (the wire form): model, salt and the file's bytes,
    nothing decoded."""
    fields = [(b"model", model_fingerprint.encode()), (b"salt", cache_salt.encode()), (b"file", data)]
    return framed_digest(_FILE_DOMAIN, fields).hex()


def is_content_hash(text: str) -> bool:
    """True when text looks like a hex content hash (64 hex digits)."""
    if len(text) != 2 * DIGEST_SIZE:
        return False
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True
