"""Fixtures for the Qwen3-VL tests. The tiny checkpoint and HF's model on it (`qwen3_model_dir`,
`qwen3_oracle`) and the three test images (`qwen_images`) are session fixtures of tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def make_qwen3_engine(qwen3_model_dir: Path):
    """Engines on the tiny Qwen3-VL checkpoint (fp32, CPU, in-process vision tower)."""
    from decoder_svc.engine import EngineConfig, LLMEngine
    from decoder_svc.engine.local_source import LocalEmbeddingSource

    def make(**overrides):
        cfg = dict(model=qwen3_model_dir, num_kv_blocks=512, max_num_batched_tokens=2048)
        cfg.update(overrides)
        config = EngineConfig(**cfg)
        return LLMEngine(config, LocalEmbeddingSource.for_engine(config))

    return make
