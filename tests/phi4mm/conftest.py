"""The phi-4-mm-tiny checkpoint (with its vision and speech LoRA in the real checkpoint's naming), made
once per session by its maker, and HF's oracle on it (the base model, and the vision adapter merged)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.families.phi4mm.maker import make_phi4_model


@pytest.fixture(scope="session")
def phi4_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random phi-4-mm-tiny checkpoint (fp32, 448 px crops, dynamic_hd 16)."""
    cache = os.environ.get("MMSERVE_TEST_MODEL_CACHE")
    root = Path(cache) if cache else tmp_path_factory.mktemp("models")
    out = root / "phi-4-mm-tiny-lora-seed0"  # with its vision and speech LoRA
    if not (out / "mmserve_model.json").exists():
        make_phi4_model("phi-4-mm-tiny", out, seed=0, device="cpu", progress=False)
    return out


@pytest.fixture(scope="session")
def phi4_oracle(phi4_tiny_dir: Path):
    """HF's Phi4MultimodalForCausalLM on the tiny checkpoint."""
    from common.families.phi4mm.oracle import Phi4Oracle

    return Phi4Oracle(phi4_tiny_dir)
