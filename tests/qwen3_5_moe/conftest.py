"""Fixtures for the Qwen3.5-MoE tests: the qwen3.5-moe-tiny checkpoint (made once per session), HF's
Qwen3_5MoeForConditionalGeneration on it, and engines over it (fp32, CPU, in-process vision tower)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.family_fixtures import engine_factory, made_checkpoint


@pytest.fixture(scope="session")
def qwen3_5_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3.5-moe-tiny checkpoint (fp32, random weights scaled so greedy output varies)."""
    return made_checkpoint(tmp_path_factory, "qwen3.5-moe-tiny", seed=0)


@pytest.fixture(scope="session")
def qwen3_5_moe_oracle(qwen3_5_moe_model_dir: Path):
    """HF's Qwen3_5MoeForConditionalGeneration, fp32 on CPU (common/families/qwen3_5_moe/oracle.py)."""
    from common.families.qwen3_5_moe.oracle import Qwen3_5MoeOracle

    return Qwen3_5MoeOracle(qwen3_5_moe_model_dir)


@pytest.fixture
def make_qwen3_5_moe_engine(qwen3_5_moe_model_dir: Path):
    """Engines on the tiny Qwen3.5-MoE checkpoint (fp32, CPU, in-process vision tower)."""
    return engine_factory(qwen3_5_moe_model_dir)
