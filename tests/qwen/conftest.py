"""Fixtures for the Qwen2.5-VL tests (the checkpoint, oracle and images are in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.family_fixtures import engine_factory


@pytest.fixture
def make_qwen_engine(qwen_model_dir: Path):
    """Engines on the tiny Qwen checkpoint (fp32, CPU, in-process vision tower)."""
    return engine_factory(qwen_model_dir)
