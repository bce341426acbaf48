"""Fixtures for the Qwen2.5-VL tests: the tiny preset, the HF oracle, images of different sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from decoder_svc.engine import EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.conftest import _made
from tests.oracle import make_image
from tests.qwen.oracle import QwenOracle


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen2.5-vl-tiny checkpoint (fp32, random weights scaled so greedy output varies)."""
    return _made(tmp_path_factory, "qwen2.5-vl-tiny", seed=0)


@pytest.fixture(scope="session")
def qwen_oracle(qwen_model_dir: Path) -> QwenOracle:
    """HF's Qwen2_5_VLForConditionalGeneration, fp32 on CPU."""
    return QwenOracle(qwen_model_dir)


@pytest.fixture(scope="session")
def qwen_images() -> list[Image.Image]:
    """224x224, 640x480 and 1000x300 (width x height): 64, 391 and 396 image tokens."""
    return [make_image(s, (h, w)) for s, (w, h) in [(11, (224, 224)), (12, (640, 480)), (13, (1000, 300))]]


@pytest.fixture
def make_qwen_engine(qwen_model_dir: Path):
    """Engines on the tiny Qwen checkpoint (fp32, CPU, in-process vision tower)."""

    def make(**overrides) -> LLMEngine:
        cfg = dict(model=qwen_model_dir, num_kv_blocks=512, max_num_batched_tokens=2048)
        cfg.update(overrides)
        config = EngineConfig(**cfg)
        return LLMEngine(config, LocalEmbeddingSource.for_engine(config))

    return make
