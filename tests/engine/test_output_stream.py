"""The decoder front end's OutputStream: one engine output per stream message, even with a backlog."""

from __future__ import annotations

import asyncio

from decoder_svc.engine.output_processor import RequestOutput, Usage
from decoder_svc.engine.request import FinishReason
from decoder_svc.stream import OutputStream


def _backlog(n: int, error_at: int | None = None) -> asyncio.Queue:
    """A queue holding a whole generation already, as when the front end fell behind the engine."""
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(n):
        if i == error_at:
            queue.put_nowait(RequestOutput("r", [], "", error="boom"))
            break
        last = i == n - 1
        queue.put_nowait(RequestOutput(
            "r", [100 + i], f"t{i} ", finish_reason=FinishReason.LENGTH if last else None,
            usage=Usage(3, n, 0, 0, 0, 0) if last else None))
    return queue


async def _read_all(stream: OutputStream) -> list[RequestOutput]:
    outputs = []
    while not outputs or not (outputs[-1].finished or outputs[-1].error):
        outputs.append(await stream.read())
    return outputs


def test_a_backlog_is_read_one_token_per_message():
    # The old stream merged every queued output into one message: TTFT equal to E2E on a busy host.
    outputs = asyncio.run(_read_all(OutputStream(_backlog(16))))
    assert [o.new_token_ids for o in outputs] == [[100 + i] for i in range(16)]
    assert [o.text for o in outputs] == [f"t{i} " for i in range(16)]
    assert [o.finished for o in outputs] == [False] * 15 + [True]
    assert outputs[-1].usage.completion_tokens == 16


def test_an_error_ends_the_stream_after_the_tokens_before_it():
    outputs = asyncio.run(_read_all(OutputStream(_backlog(6, error_at=3))))
    assert [o.new_token_ids for o in outputs] == [[100], [101], [102], []]
    assert outputs[-1].error == "boom"


class _Detok:
    """A stand-in detokenizer: a token's text is its id."""

    def add(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def finish(self) -> str:
        return "."


def test_the_front_end_detokenizer_fills_each_message():
    outputs = asyncio.run(_read_all(OutputStream(_backlog(3), _Detok)))
    assert [o.text for o in outputs] == ["<100>", "<101>", "<102>."]
