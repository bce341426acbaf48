"""Fixtures for the Qwen3-VL-MoE tests: the qwen3-vl-moe-tiny checkpoint (made once per session), HF's
Qwen3VLMoeForConditionalGeneration on it, and engines over it (fp32, CPU, in-process vision tower)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.family_fixtures import engine_factory, made_checkpoint


@pytest.fixture(scope="session")
def qwen3_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3-vl-moe-tiny checkpoint (fp32, random weights scaled so greedy output varies)."""
    return made_checkpoint(tmp_path_factory, "qwen3-vl-moe-tiny", seed=0)


@pytest.fixture(scope="session")
def qwen3_moe_oracle(qwen3_moe_model_dir: Path):
    """HF's Qwen3VLMoeForConditionalGeneration, fp32 on CPU (common/families/qwen3_vl_moe/oracle.py)."""
    from common.families.qwen3_vl_moe.oracle import Qwen3MoeOracle

    return Qwen3MoeOracle(qwen3_moe_model_dir)


@pytest.fixture
def make_qwen3_moe_engine(qwen3_moe_model_dir: Path):
    """Engines on the tiny Qwen3-VL-MoE checkpoint (fp32, CPU, in-process vision tower)."""
    return engine_factory(qwen3_moe_model_dir)
