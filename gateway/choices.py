"""An OpenAI request's choices over its decoder calls: one call per prompt, each asking the decoder for
`n` samples (GenerateRequest.n), so call k carries choices k*n .. k*n+n-1, told apart by each message's
`index`. Choices are numbered prompt-major, as OpenAI and vLLM number a list of prompts' choices."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from common.pb import decoder_pb2
from gateway.balancer import GenerationGroup


@dataclass
class Choices:
    """The request's calls (a GenerationGroup) seen as its choices: iterating gives (choice index,
    message) in the order messages arrive, each choice's messages in order."""

    calls: GenerationGroup
    per_call: int  # `n`: the samples each call asks for

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
        """Cancel every call still open (GenerationGroup.cancel)."""
        self.calls.cancel()

    async def __aiter__(self) -> AsyncIterator[tuple[int, decoder_pb2.GenerateResponse]]:
        async for call, message in self.calls:
            yield call * self.per_call + message.index, message
