"""What the wheel installs: the services and common, and no top-level `bench` (a name that would
collide in site-packages)."""

from __future__ import annotations

from pathlib import Path

import pytest
from setuptools import find_packages

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_no_top_level_bench():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(str(ROOT), include=include)
    tops = {name.split(".")[0] for name in packages}
    assert tops == {"common", "encoder_svc", "decoder_svc", "gateway"}
