"""Images and videos in system messages: vLLM takes them, and so does the gateway, but many chat templates
render only a system message's text (LLaVA-1.5's, the tiny LLaVA's). The decoder then finds fewer
placeholders than images and refuses the request; this turns that refusal into a 400 that says why."""

from __future__ import annotations

import grpc

from gateway.errors import APIError, bad_request, scrub
from gateway.schemas import ChatCompletionRequest, ImagePart, VideoPart

SYSTEM_ROLES = ("system", "developer")
_MISMATCH = "placeholders but"  # the decoder's placeholder-count refusal (decoder_svc/tokenization.py)


def system_media_param(req: object) -> str | None:
    """The first image or video part of a system (or developer) message, as a parameter name; None when
    there is none (or the request is not a chat)."""
    if not isinstance(req, ChatCompletionRequest):
        return None
    for i, message in enumerate(req.messages):
        if message.role in SYSTEM_ROLES and isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if isinstance(part, ImagePart | VideoPart):
                    return f"messages.{i}.content.{j}"
    return None


def explained(req: object, exc: grpc.aio.AioRpcError) -> APIError | None:
    """The 400 for a decoder's placeholder-count refusal of a request with system-message media (the chat
    template dropped them), else None (the decoder's own error stands)."""
    if exc.code() != grpc.StatusCode.INVALID_ARGUMENT or _MISMATCH not in (exc.details() or ""):
        return None
    param = system_media_param(req)
    if param is None:
        return None
    return bad_request(f"this model's chat template drops the images and videos of system messages (it "
                       f"renders only their text), so {param} has no place in the prompt: send it in a "
                       f"user message (the decoder: {scrub(exc.details())})", param, "system_media_dropped")
