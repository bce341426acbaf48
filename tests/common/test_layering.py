"""The layers show in the imports: the engine, the runner and the model know nothing of gRPC, the
wire format or the encoder service (the remote encoder client lives in decoder_svc/encoders/); `common`
is the bottom layer but for the command line on top (common/cli.py, common/launcher.py), which the
services never import; the kernels (common/kernels/) import nothing of the project; and no module of the
project reaches itself again through its imports (at the top or inside functions)."""

from __future__ import annotations

import ast
import sys
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


PROJECT = ("common", "encoder_svc", "decoder_svc", "gateway", "bench")


def project_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """{dotted module name: file} of every module under root/<package> (a package is its __init__.py)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _module_of(name: str, modules: dict[str, Path]) -> str | None:
    # The longest prefix of a dotted name that is one of ours (`import a.b.c` names a.b.c, or a.b if c is
    # an attribute); None for third-party names.
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(module: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `module` imports, anywhere in its file (functions and TYPE_CHECKING blocks
    included). Relative imports are resolved; `from pkg import name` imports pkg.name where that is a
    module, else pkg (its __init__)."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges.update(m for alias in node.names if (m := _module_of(alias.name, modules)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                target = name if name in modules else _module_of(base, modules)
                if target:
                    edges.add(target)
    edges.discard(module)
    return edges


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """The strongly connected groups of more than one module in the import graph (Tarjan's algorithm):
    each is at least one cycle. Empty when the imports form a DAG."""
    graph = {m: sorted(import_edges(m, modules)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in graph:
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return groups


def test_the_project_has_no_import_cycle():
    modules = project_modules(ROOT, PROJECT)
    assert "decoder_svc.model.loader" in modules and "common.kernels" in modules
    cycles = import_cycles(modules)
    # Each group, with the imports that tie it: what to cut.
    report = [{m: sorted(set(import_edges(m, modules)) & set(group)) for m in group} for group in cycles]
    assert report == []


def test_the_kernels_import_nothing_of_the_project():
    modules = project_modules(ROOT, PROJECT)
    kernels = [m for m in modules if m == "common.kernels" or m.startswith("common.kernels.")]
    assert len(kernels) > 5
    bad = {m: sorted(e for e in import_edges(m, modules) if not e.startswith("common.kernels"))
           for m in kernels}
    assert {m: e for m, e in bad.items() if e} == {}


def test_the_cycle_check_finds_cycles(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .c import C\n")
    (pkg / "a.py").write_text("import pkg.b\n")
    (pkg / "b.py").write_text("def f():\n    from .sub import c\n")  # inside a function, relative
    (pkg / "sub" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                      "    from ..a import A\n")
    (pkg / "d.py").write_text("from pkg import a\nimport os\n")  # d -> a, nothing comes back to d
    modules = project_modules(tmp_path, ("pkg",))
    assert import_edges("pkg.sub", modules) == {"pkg.sub.c"}
    assert import_edges("pkg.b", modules) == {"pkg.sub.c"}
    assert import_edges("pkg.d", modules) == {"pkg.a"}
    assert import_cycles(modules) == [["pkg.a", "pkg.b", "pkg.sub.c"]]
    (pkg / "sub" / "c.py").write_text("import os\n")  # the cycle cut
    assert import_cycles(modules) == []
