"""The services' event loop: asyncio's own, or uvloop's where it is installed and asked for.

The encoder's main process is bound by its event loop: gRPC's asyncio layer runs two RPCs per image
(Encode, Release) on it, besides the decode pool's socket callbacks and the futures of the vision
worker. uvloop runs the same callbacks with less CPU each.

`MMSERVE_EVENT_LOOP` picks: `asyncio` (the standard loop), `uvloop` (an error if it is missing), or
`auto` (the default: uvloop if it can be imported).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ENV = "MMSERVE_EVENT_LOOP"
CHOICES = ("auto", "asyncio", "uvloop")


def loop_kind(choice: str | None = None) -> str:
    """The loop that `run` will use: 'uvloop' or 'asyncio' (choice defaults to $MMSERVE_EVENT_LOOP)."""
    choice = (choice if choice is not None else os.environ.get(ENV, "auto")).strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise ValueError(f"{ENV}=uvloop, but uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], choice: str | None = None) -> T:
    """asyncio.run(main) on the chosen loop."""
    if loop_kind(choice) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def running_kind() -> str:
    """'uvloop' or 'asyncio': the loop running in this thread (for the services' startup log)."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
