"""The slow marker is automatic (tests/markers.py): the scan sees service starters through helpers, and the
run-time guard fails a quick test that starts a service process."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.markers import SERVICE_STARTERS, QuickTestGuard, _code_names, is_service_command


@pytest.mark.parametrize(("argv", "starts"), [
    (["python", "-m", "common.cli", "up"], True),
    (["python", "-m", "encoder_svc", "--port", "0"], True),
    (["python", "-m", "gateway.main"], True),
    (["/usr/local/bin/mmserve", "up"], True),
    ("mmserve encoder --port 0", True),
    (["python", "-m", "decoder_svc.runner.tp_worker", "f.tp"], False),
    (["python", "-c", "print(1)"], False),
    (["kubectl", "kustomize"], False),
    ([" ", "-m"], False),
    ([], False),
])
def test_service_command_lines(argv, starts):
    assert is_service_command(argv) is starts


def _load(tmp_path, monkeypatch, source: str):
    path = tmp_path / "planted_module.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("planted_module", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # as a collected test module is
    spec.loader.exec_module(module)
    return module


def test_the_scan_follows_local_helpers_and_command_lines(tmp_path, monkeypatch):
    module = _load(tmp_path, monkeypatch, (
        "import subprocess, sys\n"
        "class Launcher:\n"
        "    def go(self):\n"
        "        return subprocess.Popen([sys.executable, '-m', 'common.cli', 'up'])\n"
        "def helper():\n    return Launcher().go()\n"
        "def test_indirect():\n    helper()\n"
        "def fixture_like():\n    return Pair\n"
        "def test_plain():\n    return 1 + 1\n"))
    assert _code_names(module.test_indirect) & SERVICE_STARTERS
    assert _code_names(module.fixture_like) & SERVICE_STARTERS
    assert not _code_names(module.test_plain) & SERVICE_STARTERS


class _Item:
    nodeid = "tests/x.py::test_quick"

    def __init__(self, slow: bool) -> None:
        self.slow = slow

    def get_closest_marker(self, name):
        return object() if self.slow and name == "slow" else None


def test_the_guard_fails_a_quick_test_that_starts_a_service():
    guard = QuickTestGuard()
    guard.current = _Item(slow=False)
    with pytest.raises(RuntimeError, match="not marked slow"):
        guard.check(["python", "-m", "decoder_svc", "--port", "0"])
    guard.check(["python", "-c", "pass"])
    guard.current = _Item(slow=True)
    guard.check(["python", "-m", "decoder_svc", "--port", "0"])
