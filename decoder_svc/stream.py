"""The front end's output processing: one request's engine outputs as stream messages."""

from __future__ import annotations

import asyncio

from decoder_svc.engine.detokenizer import IncrementalDetokenizer
from decoder_svc.engine.output_processor import RequestOutput


class OutputStream:
    """One request's outputs, as the engine core sends them, read one message at a time.

    A read takes every output already queued and merges them, so a client that reads slower than the
    engine steps gets several tokens per message instead of a growing backlog. An error output is
    never merged: it ends the stream on its own read. With a `detokenizer` (requests without stop
    strings: the core detokenizes the others, since stopping needs the text) the read fills in the text.
    """

    def __init__(self, queue: asyncio.Queue, detokenizer: IncrementalDetokenizer | None = None) -> None:
        self._queue = queue
        self._held: RequestOutput | None = None
        self.detokenizer = detokenizer

    async def read(self) -> RequestOutput:
        """The next message's worth of output (waits for at least one)."""
        output = await self._read_merged()
        detok = self.detokenizer
        if detok is not None and not output.error:
            output.text = detok.add(output.new_token_ids) + (detok.finish() if output.finished else "")
        return output

    async def _read_merged(self) -> RequestOutput:
        output, self._held = self._held or await self._queue.get(), None
        while not output.finished and not output.error and not self._queue.empty():
            nxt: RequestOutput = self._queue.get_nowait()
            if nxt.error:
                self._held = nxt
                break
            output = RequestOutput(
                output.request_id, output.new_token_ids + nxt.new_token_ids, output.text + nxt.text,
                output.logprobs + nxt.logprobs, nxt.finish_reason, nxt.usage)
        return output
