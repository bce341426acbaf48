"""Fixtures for the Qwen3.5-MoE tests: engines over the qwen3.5-moe-tiny checkpoint (fp32, CPU, in-process
vision tower); the checkpoint and HF's model on it are tests/conftest.py's, which tests/gpu shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.family_fixtures import engine_factory


@pytest.fixture
def make_qwen3_5_moe_engine(qwen3_5_moe_model_dir: Path):
    """Engines on the tiny Qwen3.5-MoE checkpoint (fp32, CPU, in-process vision tower)."""
    return engine_factory(qwen3_5_moe_model_dir)
