"""The layers show in the imports: the engine, the runner and the model know nothing of gRPC, the
wire format or the encoder service (the remote encoder client lives in decoder_svc/encoders/); `common`
is the bottom layer but for the command line on top (common/cli.py, common/launcher.py), which the
services never import."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INNER = ("decoder_svc/engine", "decoder_svc/runner", "decoder_svc/model")
FORBIDDEN = ("grpc", "common.pb", "encoder_svc", "decoder_svc.encoders", "decoder_svc.server")


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", INNER)
def test_the_engine_layers_import_no_service_code(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = [f"{f.relative_to(ROOT)} imports {name}" for f in files for name in sorted(imported_modules(f))
           if any(name == p or name.startswith(p + ".") for p in FORBIDDEN)]
    assert bad == []


def test_the_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from encoder_svc.vision import VisionEncoder\n    import grpc\n")
    assert {"encoder_svc.vision", "grpc"} <= imported_modules(f)


SERVICES = ("encoder_svc", "decoder_svc", "gateway", "bench")
# The command line sits above the services: it dispatches to them, so only it may import them.
COMMON_ENTRY_POINTS = ("common/cli.py", "common/launcher.py")


def _imports_any(path: Path, prefixes: tuple[str, ...]) -> list[str]:
    return [name for name in sorted(imported_modules(path))
            if any(name == p or name.startswith(p + ".") for p in prefixes)]


def test_common_imports_no_service_outside_its_entry_points():
    files = [f for f in sorted((ROOT / "common").rglob("*.py"))
             if str(f.relative_to(ROOT)) not in COMMON_ENTRY_POINTS]
    assert files
    bad = [f"{f.relative_to(ROOT)} imports {name}" for f in files for name in _imports_any(f, SERVICES)]
    assert bad == []


@pytest.mark.parametrize("package", ("encoder_svc", "decoder_svc", "gateway"))
def test_the_services_import_no_command_line(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    bad = [f"{f.relative_to(ROOT)} imports {name}" for f in files
           for name in _imports_any(f, ("common.cli", "common.launcher"))]
    assert bad == []
