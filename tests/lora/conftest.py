"""Fixtures for LoRA tests: two random adapters for the tiny LLaVA checkpoint (different targets, ranks
and scalings), the checkpoints with each merged in, and HF oracles on those (the reference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.families.llava.oracle import LlavaOracle
from decoder_svc.engine import EmbeddingSource, EngineConfig, LLMEngine
from decoder_svc.engine.local_source import LocalEmbeddingSource
from tests.lora.adapters import merged_checkpoint, write_adapter

# a1: every projection, rank 4; a2: q/v and the MLP's down projection only, rank 8 with rsLoRA scaling.
ADAPTERS = {"a1": dict(seed=1), "a2": dict(seed=2, targets=("q_proj", "v_proj", "down_proj"), rank=8,
                                          alpha=4.0, rslora=True)}


@pytest.fixture(scope="session")
def lora_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{name: adapter directory} of the tiny checkpoint's test adapters."""
    root = tmp_path_factory.mktemp("lora")
    return {name: write_adapter(tiny_model_dir, root / name, **kw) for name, kw in ADAPTERS.items()}


@pytest.fixture(scope="session")
def merged_oracles(tiny_model_dir: Path, lora_dirs: dict[str, Path], hf_oracle: LlavaOracle,
                   tmp_path_factory: pytest.TempPathFactory) -> dict[str, LlavaOracle]:
    """{adapter name: HF's LLaVA on the checkpoint with it merged}; "" is the base checkpoint's."""
    root = tmp_path_factory.mktemp("merged")
    oracles = {"": hf_oracle}
    for name, path in lora_dirs.items():
        oracles[name] = LlavaOracle(merged_checkpoint(tiny_model_dir, path, root / name))
    return oracles


@pytest.fixture(scope="session")
def hf_oracle(tiny_model_dir: Path) -> LlavaOracle:
    """The HF reference model on the base checkpoint, fp32 on CPU."""
    return LlavaOracle(tiny_model_dir)


@pytest.fixture(params=["off", "on"], ids=["sync", "async"])
def make_lora_engine(tiny_model_dir: Path, lora_dirs: dict[str, Path], request: pytest.FixtureRequest):
    """A factory of engines on the tiny checkpoint serving both adapters (fp32, CPU), with synchronous and
    with asynchronous scheduling."""

    def make(source: EmbeddingSource | None = None, **overrides) -> LLMEngine:
        cfg = dict(model=tiny_model_dir, num_kv_blocks=256, max_num_batched_tokens=2048,
                   async_scheduling=request.param, lora_modules={n: str(p) for n, p in lora_dirs.items()})
        cfg.update(overrides)
        config = EngineConfig(**cfg)
        return LLMEngine(config, source if source is not None else LocalEmbeddingSource.for_engine(config))

    return make
