"""The `slow` marker, by construction: a test that starts a service (an encoder, decoder or gateway, in a
process or behind a real gRPC server, or `mmserve up`) or runs the CLI as a process is slow.
`python -m pytest -m "not slow"` leaves them out (README: the quick subset); CI runs everything.

Two halves keep the marker true without a hand-kept list:
- at collection, a test is marked when its function or a fixture it uses (each with the functions and
  classes of its own module that it names) names one of the tests' service starters (`SERVICE_STARTERS`)
  or runs `python -m common.cli`;
- at run time, a test that is not marked and still starts a service process (`python -m common.cli`,
  `-m encoder_svc`/`decoder_svc`/`gateway`, or the `mmserve` script) fails with a message that says so:
  a new way of starting services cannot slip into the quick subset unnoticed.
"""

from __future__ import annotations

import ast
import functools
import inspect
import os
import subprocess
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest

SERVICE_COMMAND = "<python -m service>"
SERVICE_MODULES = ("common.cli", "encoder_svc", "decoder_svc", "gateway")
# The tests' ways of starting services (tests/integration/harness.py, tests/gateway/harness.py,
# tests/encoder/conftest.py, tests/cli_errors.py).
SERVICE_STARTERS = frozenset({"Pair", "Service", "start_up", "running_up", "GatewayProcess", "EncoderHarness",
                              "check_up_answers_like_hf",
                              "run_cli", SERVICE_COMMAND})
# Modules slow without a starter the scan can see: bench's runners start services from outside tests/
# (the run-time check fails any such module missing here); tensor-parallel worker processes are slow too.
SLOW_OTHERWISE = frozenset({
    "tests/bench/test_bench_cpu.py",
    "tests/bench/test_chaos_smoke.py",
    "tests/bench/test_deterministic_cost.py",
    "tests/bench/test_encode_cost.py",
    "tests/bench/test_encode_tput_variants.py",
    "tests/bench/test_n_choices_rss.py",
    "tests/bench/test_qwen_workload.py",
    "tests/bench/test_soak_smoke.py",
    "tests/encoder/test_shm_sweeper.py",
    "tests/engine/test_tensor_parallel.py",
    "tests/engine/test_tensor_parallel_four.py",
})


@functools.cache
def _names_in_source(source: str) -> frozenset[str]:
    """Every identifier a piece of code names (names, attributes, imported names), and SERVICE_COMMAND
    where a constant command line starts a service (`-m common.cli`, `-m encoder_svc`, ...)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).rsplit(".", 1)[-1])
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if is_service_command(node.value.split()):
                names.add(SERVICE_COMMAND)
        elif isinstance(node, (ast.List, ast.Tuple)):
            if is_service_command([e.value if isinstance(e, ast.Constant) else "" for e in node.elts]):
                names.add(SERVICE_COMMAND)
    return frozenset(names)


def _code_names(code: object, seen: set[int] | None = None) -> frozenset[str]:
    """The identifiers a function or class names, following the functions and classes of its own module
    that it names (a fixture that starts services through a local helper)."""
    seen = set() if seen is None else seen
    if id(code) in seen:
        return frozenset()
    seen.add(id(code))
    try:
        names = set(_names_in_source(textwrap.dedent(inspect.getsource(code))))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    namespace = getattr(code, "__globals__", None) or vars(inspect.getmodule(code) or object())
    for name in list(names):
        local = namespace.get(name)
        if (inspect.isfunction(local) or inspect.isclass(local)) and local.__module__ == code.__module__:
            names |= _code_names(local, seen)
    return frozenset(names)


def starts_services(item: pytest.Item, root: str) -> bool:
    """Whether a collected test names a service starter, in its function or a fixture it uses."""
    path = str(item.path)
    if (path[len(root):] if path.startswith(root) else path) in SLOW_OTHERWISE:
        return True
    function = getattr(item, "function", None)
    if function is not None and _code_names(function) & SERVICE_STARTERS:
        return True
    fixture_info = getattr(item, "_fixtureinfo", None)
    fixtures = [] if fixture_info is None else fixture_info.name2fixturedefs.values()
    return any(_code_names(d.func) & SERVICE_STARTERS for defs in fixtures for d in defs)


def mark_slow(items: list[pytest.Item], root: str) -> None:
    """Add the slow marker to every test that starts services."""
    for item in items:
        if starts_services(item, root):
            item.add_marker(pytest.mark.slow)


def is_service_command(args: object) -> bool:
    """Whether a subprocess command line starts a service or the CLI."""
    if isinstance(args, (str, bytes, os.PathLike)):
        argv = [os.fsdecode(args)]
    elif isinstance(args, Sequence):
        argv = [os.fsdecode(a) if isinstance(a, (str, bytes, os.PathLike)) else str(a) for a in args]
    else:
        return False
    first = argv[0].split() if argv else []
    if first and Path(first[0]).name == "mmserve":
        return True
    entry_points = {f"{m}{suffix}" for m in SERVICE_MODULES for suffix in ("", ".main", ".__main__")}
    return any(flag == "-m" and module in entry_points for flag, module in zip(argv, argv[1:], strict=False))


class QuickTestGuard:
    """Fails a test outside the slow marker that starts a service process (installed for the session)."""

    def __init__(self) -> None:
        self.current: pytest.Item | None = None
        self._original_init = subprocess.Popen.__init__

    def install(self) -> None:
        guard, original = self, self._original_init

        def guarded_init(popen, args, *rest, **kwargs):
            guard.check(args)
            original(popen, args, *rest, **kwargs)

        subprocess.Popen.__init__ = guarded_init

    def uninstall(self) -> None:
        subprocess.Popen.__init__ = self._original_init

    def check(self, args: object) -> None:
        item = self.current
        if item is None or item.get_closest_marker("slow") is not None or not is_service_command(args):
            return
        raise RuntimeError(
            f"{item.nodeid} starts a service process ({args!r}) but is not marked slow: start services "
            f"through one of tests/markers.py's SERVICE_STARTERS, or list the module there")
