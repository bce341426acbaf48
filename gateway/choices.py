"""An OpenAI request's choices over its decoder calls: one call per prompt, each asking the decoder for
`n` samples (GenerateRequest.n), so call k carries choices k*n .. k*n+n-1, told apart by each message's
`index`. Choices are numbered prompt-major, as OpenAI and vLLM number a list of prompts' choices."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from common.pb import decoder_pb2
from gateway.balancer import GenerationGroup
from gateway.decoder_retry import DecoderAttempts


@dataclass
class Choices:
    """The request's calls (a GenerationGroup) seen as its choices: iterating gives (choice index,
    message) in the order messages arrive, each choice's messages in order."""

    calls: GenerationGroup
    per_call: int  # `n`: the samples each call asks for
    attempts: DecoderAttempts | None = None  # how the calls were started; None: they cannot be restarted
    on_end: Callable[[], None] | None = None  # called once, at the first cancel(): the request has ended
    first_token_seen: bool = False  # across restarts: TTFT is observed once per request
    usage_seen: set[int] = field(default_factory=set)  # the choices whose usage the metrics have counted

    @property
    def request_id(self) -> str:
        """The OpenAI response's id."""
        return self.calls.request_id

    @property
    def num(self) -> int:
        """Choices in all."""
        return len(self.calls.members) * self.per_call

    @property
    def firsts(self) -> list[decoder_pb2.GenerateResponse | None]:
        """Each call's first message (one per prompt), as the decoder sent it before any was streamed."""
        return [member.first for member in self.calls.members]

    def cancel(self) -> None:
        """Cancel every call still open (GenerationGroup.cancel); the first time, call on_end."""
        self.calls.cancel()
        if self.on_end is not None:
            on_end, self.on_end = self.on_end, None
            on_end()

    async def restart(self, exc: grpc.aio.AioRpcError) -> bool:
        """After exc ended the calls with nothing of them sent to the client: start them again on another
        decoder (DecoderAttempts.again's rules) and iterate those from now on. False when not restarted
        (the caller raises exc)."""
        self.calls.cancel()
        if self.attempts is None:
            return False
        calls = await self.attempts.again(exc)
        if calls is None:
            return False
        self.calls = calls
        return True

    async def __aiter__(self) -> AsyncIterator[tuple[int, decoder_pb2.GenerateResponse]]:
        async for call, message in self.calls:
            yield call * self.per_call + message.index, message
