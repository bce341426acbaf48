"""Fixtures for engine tests: the HF oracle on the tiny checkpoint and seeded test images."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from common.families.llava.oracle import LlavaOracle
from tests.family_fixtures import engine_factory
from tests.oracle import make_image


@pytest.fixture(scope="session")
def hf_oracle(tiny_model_dir: Path) -> LlavaOracle:
    """The HF reference model, fp32 on CPU."""
    return LlavaOracle(tiny_model_dir)


@pytest.fixture(scope="session")
def images() -> list[Image.Image]:
    """Four distinct seeded images of different sizes."""
    return [make_image(s, size) for s, size in [(1, (40, 52)), (2, (28, 28)), (3, (64, 30)), (4, (33, 47))]]


@pytest.fixture(params=["off", "on"], ids=["sync", "async"])
def make_engine(tiny_model_dir: Path, request: pytest.FixtureRequest):
    """A factory of engines on the tiny checkpoint (fp32, CPU) with overridable config; every test that
    uses it runs with synchronous and with asynchronous scheduling (the GPU's default)."""
    return engine_factory(tiny_model_dir, num_kv_blocks=256, async_scheduling=request.param)
