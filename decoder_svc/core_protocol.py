"""The messages between the decoder's front end (core_client.py) and its engine core process
(engine_core.py), one dataclass each; both ends import them from here and nowhere else.

Front end -> core: a `CoreCall` (`AddRequest`, `AbortRequest`, `GetStats`) answered by one `Reply`
with the same token; right after an `AddRequest` whose images are files, their `ImageBytes` (no reply);
`Close` to stop.

Core -> front end, in order: `Ready` once loaded and warmed up, or `StartRefused` when the options leave
no room for a request (a usage error), or `StartFailed` when it could not start; then `StepOutputs`
after each step that produced any, `Reply`s as calls are served, and `Died` if the engine fails in a
way it cannot absorb (the process then exits 1).

The pipe pickles them; every message is small but `ImageBytes`, which follows its request so that the
request is scheduled without waiting for megabytes it may never need (engine/following_bytes.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from decoder_svc.engine.output_processor import RequestOutput
from decoder_svc.engine.request import Request


@dataclass(frozen=True)
class CoreInfo:
    """What the front end needs to know of a started core."""

    kv_capacity_tokens: int
    num_kv_blocks: int
    block_size: int


# -- front end -> core ---------------------------------------------------------------------------
@dataclass(frozen=True)
class AddRequest:
    """Queue a request made by the front end's InputProcessor; the reply's value is None."""

    token: int
    request: Request


@dataclass(frozen=True)
class AbortRequest:
    """Stop a request; the reply's value says whether it was known. Its ABORT output follows."""

    token: int
    request_id: str


@dataclass(frozen=True)
class GetStats:
    """The engine's and the embedding source's counters; the reply's value is a DecoderStats."""

    token: int


CoreCall = AddRequest | AbortRequest | GetStats


@dataclass(frozen=True)
class ImageBytes:
    """The encoded files of a request's images, in placeholder order, for its FollowingBytes (no reply)."""

    request_id: str
    files: list[bytes]


@dataclass(frozen=True)
class Close:
    """Stop the core."""


# -- core -> front end ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The core is loaded and warm."""

    info: CoreInfo


@dataclass(frozen=True)
class StartRefused:
    """The options leave no room for a request, or name a checkpoint we cannot serve (exit 2)."""

    message: str


@dataclass(frozen=True)
class StartFailed:
    """The core could not start; `traceback` says why."""

    traceback: str


@dataclass(frozen=True)
class Reply:
    """The answer to the call with `token`: its value, or (ok False) the exception it raised."""

    token: int
    ok: bool
    value: Any


@dataclass(frozen=True)
class StepOutputs:
    """The outputs of one step and how long the step took."""

    outputs: list[RequestOutput]
    step_seconds: float


@dataclass(frozen=True)
class Died:
    """The engine failed in a way it cannot absorb; the core exits after sending this."""

    message: str
