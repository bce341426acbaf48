"""The tests' embedding sources: a scripted one with no model (FakeSource), and wrappers of a real
source that hold images back or fail them (GatedSource) or overwrite released rows (PoisoningSource).
An engine takes one with `make_engine(source=...)` (tests/engine/conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decoder_svc.engine.embedding_source import EmbeddingRequest, EmbeddingSource, EmbeddingState
from decoder_svc.engine.request import Request


class FakeSource(EmbeddingSource):
    """Embeddings of `hidden` zeros that become ready (or fail) when the test says so; records every
    call."""

    def __init__(self, hidden: int = 8) -> None:
        self.hidden = hidden
        self.status: dict[tuple[str, str], EmbeddingState] = {}
        self.ready_hashes: set[str] = set()
        self.failing_hashes: set[str] = set()
        self.asks: list[EmbeddingRequest] = []
        self.released: list[tuple[str, str | None]] = []

    def request(self, req: EmbeddingRequest) -> None:
        self.asks.append(req)
        self.status.setdefault((req.request_id, req.content_hash), EmbeddingState.PENDING)

    def poll(self, request_id: str, content_hash: str) -> EmbeddingState:
        key = (request_id, content_hash)
        if key not in self.status:
            return EmbeddingState.UNKNOWN
        if content_hash in self.failing_hashes:
            return EmbeddingState.FAILED
        return EmbeddingState.READY if content_hash in self.ready_hashes else EmbeddingState.PENDING

    def get(self, request_id: str, content_hash: str) -> torch.Tensor:
        return torch.zeros(4, self.hidden)

    def release(self, request_id: str, content_hash: str | None = None) -> None:
        self.released.append((request_id, content_hash))
        for key in [k for k in self.status if k[0] == request_id and content_hash in (None, k[1])]:
            del self.status[key]

    def held(self) -> set[tuple[str, str]]:
        """Keys asked for and not released."""
        return set(self.status)


class WrappingSource(EmbeddingSource):
    """Every call passed to `inner`; subclasses change the ones they test."""

    def __init__(self, inner: EmbeddingSource) -> None:
        self.inner = inner

    def request(self, req: EmbeddingRequest) -> None:
        self.inner.request(req)

    def poll(self, request_id: str, content_hash: str) -> EmbeddingState:
        return self.inner.poll(request_id, content_hash)

    def get(self, request_id: str, content_hash: str) -> torch.Tensor:
        return self.inner.get(request_id, content_hash)

    def release(self, request_id: str, content_hash: str | None = None) -> None:
        self.inner.release(request_id, content_hash)

    def error(self, request_id: str, content_hash: str) -> str:
        return self.inner.error(request_id, content_hash)

    def cache_hit(self, request_id: str, content_hash: str) -> bool:
        return self.inner.cache_hit(request_id, content_hash)

    def close(self) -> None:
        self.inner.close()


class GatedSource(WrappingSource):
    """Keeps chosen hashes PENDING (`closed`) or FAILED (`failing`) until the test says otherwise;
    records every ask and release."""

    def __init__(self, inner: EmbeddingSource) -> None:
        super().__init__(inner)
        self.closed: set[str] = set()
        self.failing: set[str] = set()
        self.asks: list[EmbeddingRequest] = []
        self.released: list[tuple[str, str | None]] = []

    def request(self, req: EmbeddingRequest) -> None:
        self.asks.append(req)
        self.inner.request(req)

    def poll(self, request_id: str, content_hash: str) -> EmbeddingState:
        status = self.inner.poll(request_id, content_hash)
        if status == EmbeddingState.UNKNOWN:
            return status
        if content_hash in self.failing:
            return EmbeddingState.FAILED
        return EmbeddingState.PENDING if content_hash in self.closed else status

    def release(self, request_id: str, content_hash: str | None = None) -> None:
        self.released.append((request_id, content_hash))
        self.inner.release(request_id, content_hash)

    def error(self, request_id: str, content_hash: str) -> str:
        if content_hash in self.failing:
            return "encoder exploded"
        return self.inner.error(request_id, content_hash)


@dataclass(frozen=True)
class Release:
    """One release call and the request's progress at that moment."""

    request_id: str
    content_hash: str | None
    num_computed_tokens: int
    spans: tuple[tuple[int, int], ...]  # (offset, end) of each of the request's images with that hash
    queued: bool  # the request was still running or waiting (it is not leaving)


class PoisoningSource(WrappingSource):
    """Plays an encoder that reuses a released slice at once: private copies from `get`, NaN-filled at
    `release`; every release recorded with the request's progress. Set `scheduler` before use."""

    def __init__(self, inner: EmbeddingSource) -> None:
        super().__init__(inner)
        self.scheduler = None
        self.requests: dict[str, Request] = {}
        self.releases: list[Release] = []
        self.handed_out: dict[tuple[str, str], list[torch.Tensor]] = {}
        self.gets_after_release: list[tuple[str, str]] = []
        self._live: set[tuple[str, str]] = set()

    def request(self, req: EmbeddingRequest) -> None:
        self._live.add((req.request_id, req.content_hash))
        self.inner.request(req)

    def get(self, request_id: str, content_hash: str) -> torch.Tensor:
        if (request_id, content_hash) not in self._live:
            self.gets_after_release.append((request_id, content_hash))
        rows = self.inner.get(request_id, content_hash).clone()
        self.handed_out.setdefault((request_id, content_hash), []).append(rows)
        return rows

    def release(self, request_id: str, content_hash: str | None = None) -> None:
        req = self.requests[request_id]
        spans = tuple((img.offset, img.end) for img in req.images
                      if content_hash is None or img.content_hash == content_hash)
        queued = req in self.scheduler.running or req in self.scheduler.waiting
        self.releases.append(Release(request_id, content_hash, req.num_computed_tokens, spans, queued))
        keys = [k for k in self.handed_out if k[0] == request_id and content_hash in (None, k[1])]
        with torch.inference_mode():  # the rows were made in a step, as inference tensors
            for key in keys:
                for rows in self.handed_out.pop(key):
                    rows.fill_(float("nan"))  # the slice now holds something else
        self._live -= {k for k in self._live if k[0] == request_id and content_hash in (None, k[1])}
        self.inner.release(request_id, content_hash)
