"""Cache-aware choice of a decoder: send a request where its prefix and images probably are already.

The gateway keeps, per decoder, an approximate index of what it sent there lately (a bounded LRU of
keys): the chained hashes of the prompt's leading chunks (the tenant's cache_salt and the LoRA adapter
first, as the decoder's prefix cache keys them) and the images' and videos' content. A request scores each
decoder by how many of its leading chunks, and how many of its images, that decoder's index holds.

Load comes first: only decoders within `slack` outstanding requests of the least loaded one compete on
cache (slack grows with the load: max(balance_abs, balance_rel x least)), so one hot image or one long
conversation cannot pin a decoder while the others idle. Without any hit, a request that names a `user`
goes to that user's decoder among those (rendezvous hashing: stable while the set is); else to the least
loaded one, as least-outstanding routing does.

The index is the gateway's guess, never the decoder's truth: a decoder that evicted a prefix still
scores for it until the gateway's LRU forgets it; a wrong guess costs a prefill, never a wrong answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from common.pb import decoder_pb2

ROUTING_POLICIES = ("least-outstanding", "cache-aware")
CHUNK_CHARS = 128  # prefix granularity: about 32 tokens of text
IMAGE_WEIGHT = 8   # an image counts as this many chunks (its tokens, and its encode, saved)


class Endpoint(Protocol):
    address: str
    outstanding: int


def _h(*parts: bytes) -> str:
    digest = hashlib.blake2b(digest_size=12)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


@dataclass(frozen=True)
class RouteKeys:
    """What a request would find cached on a decoder: its prefix chain and its media."""

    prefix: tuple[str, ...] = ()
    media: tuple[str, ...] = ()
    user: str = ""

    @property
    def empty(self) -> bool:
        return not self.prefix and not self.media


def _media_key(head: str, media) -> str:
    return _h(head.encode(), media.content_hash.encode() or media.data)


def _prompt_bytes(request: decoder_pb2.GenerateRequest, head: str, media: list[str]) -> bytes:
    """The prompt as the decoder's template would lay it out, each image or video by its key (appended
    to media) where it stands: earlier turns of a conversation come first."""
    if request.HasField("chat"):
        out = []
        for message in request.chat.messages:
            out.append(f"\x1e{message.role}\x1f")
            for part in message.content:
                kind = part.WhichOneof("part")
                if kind == "text":
                    out.append(part.text)
                elif kind is not None:
                    media.append(_media_key(head, getattr(part, kind)))
                    out.append(f"\x1d{media[-1]}\x1d")
        text = "".join(out)
    elif request.HasField("prompt_token_ids"):
        text = ",".join(map(str, request.prompt_token_ids.ids))
    else:
        text = request.prompt
    return text.encode("utf-8", "surrogatepass")


def route_keys(request: decoder_pb2.GenerateRequest, user: str = "",
               chunk_chars: int = CHUNK_CHARS) -> RouteKeys:
    """The request's keys: a hash per full chunk of its prompt, each chained on the ones before (so a
    follow-up turn shares its conversation's chain), and one per image or video."""
    head = _h(request.cache_salt.encode(), request.lora_adapter.encode())
    media = [_media_key(head, m) for m in (*request.images, *request.videos)]
    text = _prompt_bytes(request, head, media)
    chain, h = [], head
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        h = _h(h.encode(), text[start:start + chunk_chars])
        chain.append(h)
    return RouteKeys(tuple(chain), tuple(dict.fromkeys(media)), user)


class RecentKeys:
    """A bounded LRU of keys one decoder was sent."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def score(self, keys: RouteKeys) -> int:
        """Leading prefix chunks held (a chain breaks at the first miss), plus weighted media held."""
        held = 0
        for key in keys.prefix:
            if key not in self._keys:
                break
            held += 1
        return held + IMAGE_WEIGHT * sum(key in self._keys for key in keys.media)


@dataclass
class CacheAwareRouter:
    """Picks among usable decoders by cache score within a load slack (see the module docstring)."""

    balance_abs: int = 4
    balance_rel: float = 0.5
    capacity: int = 100_000  # keys remembered per decoder
    _index: dict[str, RecentKeys] = field(default_factory=dict)
    hits: int = 0    # requests sent where the index promised a hit
    misses: int = 0

    def slack(self, least: int) -> int:
        return max(self.balance_abs, int(self.balance_rel * least))

    def index(self, address: str) -> RecentKeys:
        found = self._index.get(address)
        if found is None:
            found = self._index[address] = RecentKeys(self.capacity)
        return found

    def choose(self, candidates: Sequence[Endpoint], keys: RouteKeys) -> Endpoint:
        """The decoder for a request (candidates in the pool's turn order: ties go to the first)."""
        least = min(e.outstanding for e in candidates)
        eligible = [e for e in candidates if e.outstanding <= least + self.slack(least)]
        scores = [self.index(e.address).score(keys) for e in eligible]
        best = max(scores)
        if best > 0:  # the most held; among equals the less loaded
            self.hits += 1
            return min((e for e, s in zip(eligible, scores, strict=True) if s == best),
                       key=lambda e: e.outstanding)
        self.misses += 1
        if keys.user:
            return max(eligible, key=lambda e: _h(keys.user.encode(), e.address.encode()))
        return min(eligible, key=lambda e: e.outstanding)

    def sent(self, address: str, keys: RouteKeys) -> None:
        """Remember that address now holds (or soon will) what keys name."""
        self.index(address).add([*keys.prefix, *keys.media])

    def forget(self, address: str) -> None:
        """A decoder that left the pool: a replacement at its address starts cold."""
        self._index.pop(address, None)
