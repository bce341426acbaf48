"""The layers show in the imports: the engine, the runner and the model know nothing of gRPC, the
wire format or the encoder service (the remote encoder client lives in decoder_svc/encoders/)."""

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
