"""Fixtures for the Qwen3-VL tests. The tiny checkpoint and HF's model on it (`qwen3_model_dir`,
`qwen3_oracle`) and the three test images (`qwen_images`) are session fixtures of tests/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.family_fixtures import engine_factory


@pytest.fixture
def make_qwen3_engine(qwen3_model_dir: Path):
    """Engines on the tiny Qwen3-VL checkpoint (fp32, CPU, in-process vision tower)."""
    return engine_factory(qwen3_model_dir)
