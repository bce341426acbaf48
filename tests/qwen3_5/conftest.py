"""Fixtures for the Qwen3.5 tests: engines over the tiny checkpoint (the checkpoint and HF's model on it are
tests/conftest.py's, which tests/gpu shares)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.family_fixtures import engine_factory


@pytest.fixture
def make_qwen3_5_engine(qwen3_5_model_dir: Path):
    """Engines on the tiny Qwen3.5 checkpoint (fp32, CPU, in-process vision tower)."""
    return engine_factory(qwen3_5_model_dir)


@pytest.fixture
def fake_fla_graphs(monkeypatch):
    """Every linear layer on FakeFla (fla's contract in torch, with the real in-place Triton kernels in
    Triton's interpreter) and the runner on tests/engine/test_graph_shapes.py's emulated graphs; the
    FakeFla, which records the rules' calls."""
    from decoder_svc.runner import model_runner
    from tests.engine.test_graph_shapes import EmulatedGraphs
    from tests.qwen3_5.linear_steps import FakeFla

    fake = FakeFla(in_place=True)
    monkeypatch.setattr("decoder_svc.model.gated_deltanet.kernels_for", lambda device: fake.kernels())
    monkeypatch.setattr(model_runner, "StepGraphs", EmulatedGraphs)
    return fake
