"""Fixtures for the Qwen3-VL tests: the tiny checkpoint (made once per session) and HF's model on it.
The three test images (224x224, 640x480, 1000x300) are tests/conftest.py's `qwen_images`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.model_maker import make_model


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3-vl-tiny checkpoint (fp32, random weights scaled so greedy output varies)."""
    # MMSERVE_TEST_MODEL_CACHE lets repeated local runs reuse checkpoints, as in tests/conftest.py.
    cache = os.environ.get("MMSERVE_TEST_MODEL_CACHE")
    out = (Path(cache) if cache else tmp_path_factory.mktemp("models")) / "qwen3-vl-tiny-seed0"
    if not (out / "mmserve_model.json").exists():
        make_model("qwen3-vl-tiny", out, seed=0, device="cpu", progress=False)
    return out


@pytest.fixture(scope="session")
def qwen3_oracle(qwen3_model_dir: Path):
    """HF's Qwen3VLForConditionalGeneration, fp32 on CPU (tests/qwen3/oracle.py)."""
    from tests.qwen3.oracle import Qwen3Oracle

    return Qwen3Oracle(qwen3_model_dir)


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
