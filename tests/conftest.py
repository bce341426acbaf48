"""Shared fixtures: checkpoints made by the model maker, once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.model_maker import make_model


def _made(tmp_path_factory: pytest.TempPathFactory, preset: str, seed: int) -> Path:
    # MMSERVE_TEST_MODEL_CACHE lets repeated local runs reuse checkpoints; CI makes them fresh.
    cache = os.environ.get("MMSERVE_TEST_MODEL_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("models")
    out = root / f"{preset}-seed{seed}"
    if not (out / "mmserve_model.json").exists():
        make_model(preset, out, seed=seed, device="cpu", progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA checkpoint (fp32, 16 image tokens)."""
    return _made(tmp_path_factory, "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny checkpoint with other weights (for model-sensitivity tests)."""
    return _made(tmp_path_factory, "tiny", seed=1)
