"""The front end sends a new file ahead to its encoder only while few requests await their first token
(decoder_svc/server.py): behind a backlog the engine's lookahead asks for images in queue order."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from decoder_svc.engine.request import ImagePlaceholder
from decoder_svc.server import DecoderServicer


class RecordingLink:
    """A FrontEndLink stand-in: records what is sent ahead."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send_ahead(self, files, cache_salt: str = "") -> int:
        self.sent += [f.content_hash for f in files]
        return len(files)


def _request(n: int) -> SimpleNamespace:
    return SimpleNamespace(cache_salt="", images=[ImagePlaceholder(0, 4, f"{n:064x}", image=b"file %d" % n)])


def test_files_go_ahead_only_while_few_requests_await_their_first_token():
    link = RecordingLink()
    inputs = SimpleNamespace(config=SimpleNamespace(encoder_max_ahead=2))
    servicer = DecoderServicer(core=None, inputs=inputs, encoders=link)
    assert servicer.send_ahead_depth == 2

    async def run() -> list:
        reqs = [_request(n) for n in range(4)]
        for awaiting, req in zip((1, 2, 3, 1), reqs, strict=True):  # this request counted in each
            servicer.awaiting_first_token = awaiting
            servicer._send_files_ahead(req)
        return reqs

    reqs = asyncio.run(run())  # which waits for the sends in the loop's default executor
    assert link.sent == [reqs[i].images[0].content_hash for i in (0, 1, 3)]
    assert [r.images[0].sent_ahead for r in reqs] == [True, True, False, True]  # the third: with its request
