"""The services' event loop: uvloop where installed (the default), asyncio's own on request."""

from __future__ import annotations

import asyncio

import pytest

from common import event_loop


async def _kind() -> str:
    await asyncio.sleep(0)
    return event_loop.running_kind()


def test_asyncio_on_request_and_uvloop_by_default_where_installed(monkeypatch):
    monkeypatch.setenv(event_loop.ENV, "asyncio")
    assert event_loop.loop_kind() == "asyncio" and event_loop.run(_kind()) == "asyncio"
    monkeypatch.delenv(event_loop.ENV)
    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert event_loop.loop_kind() == "asyncio"
        with pytest.raises(ValueError, match="not installed"):
            event_loop.loop_kind("uvloop")
        return
    assert event_loop.loop_kind() == "uvloop" and event_loop.run(_kind()) == "uvloop"
    assert event_loop.run(_kind(), "uvloop") == "uvloop"


def test_an_unknown_choice_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(event_loop.ENV, "trio")
    with pytest.raises(ValueError, match="MMSERVE_EVENT_LOOP='trio': expected one of auto, asyncio, uvloop"):
        event_loop.loop_kind()
