"""Fixtures for the Qwen3.5 tests: the tiny checkpoint, HF's model on it, and engines over it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.family_fixtures import engine_factory, made_checkpoint


@pytest.fixture(scope="session")
def qwen3_5_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3.5-tiny checkpoint (fp32, random weights scaled so greedy output varies)."""
    return made_checkpoint(tmp_path_factory, "qwen3.5-tiny", seed=0)


@pytest.fixture(scope="session")
def qwen3_5_oracle(qwen3_5_model_dir: Path):
    """HF's Qwen3_5ForConditionalGeneration, fp32 on CPU (common/families/qwen3_5/oracle.py); `generate`
    remembers its answers."""
    from common.families.qwen3_5.oracle import Qwen3_5Oracle

    return Qwen3_5Oracle(qwen3_5_model_dir)


@pytest.fixture
def make_qwen3_5_engine(qwen3_5_model_dir: Path):
    """Engines on the tiny Qwen3.5 checkpoint (fp32, CPU, in-process vision tower)."""
    return engine_factory(qwen3_5_model_dir)
