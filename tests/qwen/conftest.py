"""Fixtures for the Qwen2.5-VL tests (the checkpoint, oracle and images are in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource


@pytest.fixture
def make_qwen_engine(qwen_model_dir: Path):
    """Engines on the tiny Qwen checkpoint (fp32, CPU, in-process vision tower)."""

    def make(**overrides) -> LLMEngine:
        cfg = dict(model=qwen_model_dir, num_kv_blocks=512, max_num_batched_tokens=2048)
        cfg.update(overrides)
        config = EngineConfig(**cfg)
        return LLMEngine(config, LocalEmbeddingSource.for_engine(config))

    return make
