"""The in-process decoder engine: requests, scheduler, block manager, image bookkeeping, input and output
processing, and the step loop. Names are imported on first use, so that reading the configuration
(`decoder_svc.engine.config`) does not load torch."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "EmbeddingRequest": "embedding_source", "EmbeddingSource": "embedding_source",
    "EmbeddingState": "embedding_source", "EngineConfig": "config", "EngineStats": "engine",
    "LLMEngine": "engine", "QueueFullError": "engine", "RequestOutput": "output_processor",
    "Usage": "output_processor", "FinishReason": "request", "InvalidRequestError": "sampling_params",
    "SamplingParams": "sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
