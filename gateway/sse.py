"""Server-sent events for OpenAI streams: `data: <json>` events, closed by `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.responses import StreamingResponse
from starlette.types import Send


def sse_event(data: dict | str) -> str:
    """One event; a dict is sent as compact JSON."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its body iterator.

    Starlette cancels the body when the client disconnects (ASGI < 2.4) or lets `send` raise (2.4+); in
    either case the iterator's `finally` must run now, not at garbage collection, because that is where
    the gRPC call is cancelled and the decoder frees the request's KV blocks and leases.
    """

    media_type = "text/event-stream"

    def __init__(self, content, on_close: Callable[[], None] | None = None) -> None:
        # no-cache and no proxy buffering: tokens must reach the client as they are made.
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close  # also when the body never started (aclose() then runs no finally)

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()
            if self.on_close is not None:
                self.on_close()
