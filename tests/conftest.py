"""Shared fixtures: checkpoints made by the model maker, once per test session (tests/family_fixtures.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.family_fixtures import made_checkpoint

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU): the kernel tests still
# check them in CI. Set before any kernel module is imported, since triton.jit reads it then.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # One intra-op thread in the test process (the services it starts keep their own): CI's two xdist
        # workers share two cores with those services, and OpenMP threads waiting on a busy core slowed the
        # small products of the tiny models several-fold. OMP_NUM_THREADS, where set, still decides.
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a dependency
    pass


def _patch_triton_interpreter() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int(array of shape (1,)), which
    NumPy >= 2.4 refuses; a kernel's `range(lo, hi)` over loaded bounds then fails. Use .item()."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_triton_interpreter()


# The name tests import it by (tests/family_fixtures.py's made_checkpoint).
_made = made_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaVA checkpoint (fp32, 16 image tokens)."""
    return made_checkpoint(tmp_path_factory, "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_other(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second tiny checkpoint with other weights (for model-sensitivity tests)."""
    return made_checkpoint(tmp_path_factory, "tiny", seed=1)


@pytest.fixture(scope="session")
def qwen_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen2.5-vl-tiny checkpoint (fp32, random weights scaled so greedy output varies)."""
    return made_checkpoint(tmp_path_factory, "qwen2.5-vl-tiny", seed=0)


@pytest.fixture(scope="session")
def qwen_oracle(qwen_model_dir: Path):
    """HF's Qwen2_5_VLForConditionalGeneration, fp32 on CPU (common/families/qwen2_5_vl/oracle.py)."""
    from common.families.qwen2_5_vl.oracle import QwenOracle

    return QwenOracle(qwen_model_dir)


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3-vl-tiny checkpoint (fp32, random weights scaled so greedy output varies)."""
    return made_checkpoint(tmp_path_factory, "qwen3-vl-tiny", seed=0)


@pytest.fixture(scope="session")
def qwen3_oracle(qwen3_model_dir: Path):
    """HF's Qwen3VLForConditionalGeneration, fp32 on CPU (common/families/qwen3_vl/oracle.py)."""
    from common.families.qwen3_vl.oracle import Qwen3Oracle

    return Qwen3Oracle(qwen3_model_dir)


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


@pytest.fixture(scope="session")
def qwen3_5_moe_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The qwen3.5-moe-tiny checkpoint (fp32, random weights scaled so greedy output varies)."""
    return made_checkpoint(tmp_path_factory, "qwen3.5-moe-tiny", seed=0)


@pytest.fixture(scope="session")
def qwen3_5_moe_oracle(qwen3_5_moe_model_dir: Path):
    """HF's Qwen3_5MoeForConditionalGeneration, fp32 on CPU (common/families/qwen3_5_moe/oracle.py)."""
    from common.families.qwen3_5_moe.oracle import Qwen3_5MoeOracle

    return Qwen3_5MoeOracle(qwen3_5_moe_model_dir)


@pytest.fixture(scope="session")
def qwen_images() -> list:
    """224x224, 640x480 and 1000x300 (width x height): 64, 391 and 396 image tokens."""
    from tests.oracle import make_image

    return [make_image(s, (h, w)) for s, (w, h) in [(11, (224, 224)), (12, (640, 480)), (13, (1000, 300))]]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests that start services `slow` (tests/markers.py): `-m "not slow"` is the quick subset."""
    from tests.markers import mark_slow

    mark_slow(items, str(config.rootpath) + "/")


def pytest_configure(config: pytest.Config) -> None:
    from tests.markers import QuickTestGuard

    config._mmserve_quick_guard = QuickTestGuard()
    config._mmserve_quick_guard.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    guard = getattr(config, "_mmserve_quick_guard", None)
    if guard is not None:
        guard.uninstall()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Set before fixtures run: a module-scoped fixture starts its services in its first test's setup.
    item.config._mmserve_quick_guard.current = item
