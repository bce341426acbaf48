"""What the families' test fixtures share: a random checkpoint made once per session, and engines over one.

Imports nothing of the decoder at module level: tests/conftest.py imports this before it sets
TRITON_INTERPRET, which kernel modules read when they are imported.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from common.model_maker import make_model

if TYPE_CHECKING:
    from decoder_svc.engine import EmbeddingSource, LLMEngine


def made_checkpoint(tmp_path_factory: pytest.TempPathFactory, preset: str, seed: int = 0,
                    name: str | None = None, maker: Callable[..., Path] = make_model,
                    **maker_options: Any) -> Path:
    """preset's random checkpoint (CPU, seed), written by `maker` once as `name` (default
    <preset>-seed<seed>) into MMSERVE_TEST_MODEL_CACHE, which lets repeated local runs reuse checkpoints
    (CI makes them fresh, into a session folder)."""
    cache = os.environ.get("MMSERVE_TEST_MODEL_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("models")
    out = root / (name or f"{preset}-seed{seed}")
    if not (out / "mmserve_model.json").exists():
        maker(preset, out, seed=seed, device="cpu", progress=False, **maker_options)
    return out


def engine_factory(model_dir: Path, **defaults: Any) -> Callable[..., LLMEngine]:
    """A factory of engines on model_dir (CPU; 512 KV blocks, 2048 batched tokens, then `defaults`, then
    each call's EngineConfig overrides) over `source`, default the in-process vision tower's."""

    def make(source: EmbeddingSource | None = None, **overrides: Any) -> LLMEngine:
        from decoder_svc.engine import EngineConfig, LLMEngine
        from decoder_svc.engine.local_source import LocalEmbeddingSource

        config = EngineConfig(**{"model": model_dir, "num_kv_blocks": 512, "max_num_batched_tokens": 2048,
                                 **defaults, **overrides})
        return LLMEngine(config, source if source is not None else LocalEmbeddingSource.for_engine(config))

    return make
