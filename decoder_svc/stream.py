"""The front end's output processing: one request's engine outputs as stream messages."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from decoder_svc.engine.detokenizer import IncrementalDetokenizer
from decoder_svc.engine.output_processor import RequestOutput


class OutputStream:
    """One request's outputs, as the engine core sends them, read one message at a time.

    Each read is one engine output: one step's token (with its text and logprobs), the last one with the
    finish reason and usage, or an error. Outputs are never merged, even when the front end has fallen
    behind the engine and several wait in the queue. Merging them (as this class once did) made a busy
    host send a whole generation as one message, so a client saw its first token only with the last (TTFT
    equal to end-to-end latency) and an SSE event with many tokens; one token per message is what
    OpenAI clients and benchmark tools (aiperf, guidellm) count tokens and inter-token latency by. The
    backlog this may leave is bounded by the request's max_tokens and costs one small message per token.
    With a `detokenizer` factory (requests without stop strings: the core detokenizes the others, since
    stopping needs the text) the read fills in the text, with one detokenizer per choice (`index`) of a
    request for n samples.
    """

    def __init__(self, queue: asyncio.Queue,
                 detokenizer: Callable[[], IncrementalDetokenizer] | None = None) -> None:
        self._queue = queue
        self._make_detokenizer = detokenizer
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}

    async def read(self) -> RequestOutput:
        """The next engine output (waits for it)."""
        output: RequestOutput = await self._queue.get()
        if self._make_detokenizer is None or output.error:
            return output
        detok = self._detokenizers.get(output.index)
        if detok is None:
            detok = self._detokenizers[output.index] = self._make_detokenizer()
        output.text = detok.add(output.new_token_ids) + (detok.finish() if output.finished else "")
        return output
