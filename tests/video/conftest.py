"""Fixtures of the video tests: the Qwen3-VL checkpoint and oracle of tests/qwen3 (the Qwen2.5-VL ones are
session fixtures of tests/conftest.py)."""

from tests.qwen3.conftest import qwen3_model_dir, qwen3_oracle  # noqa: F401 - fixtures shared with tests/qwen3
