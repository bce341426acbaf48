"""The family seam's scanner: where a module names a model family in code, read with ast (identifiers,
attribute names, imported names and modules, string constants), so that a new family is its folder plus
its registry line and no shared module learns its name. Docstrings and comments are prose, not code:
they are not read."""

from __future__ import annotations

import ast
from collections.abc import Iterator

# Stems of the families' names as code spells them (QwenImageLayout, load_qwen_video_config, "llava",
# Phi4Pixels); every family's name and model_types are added by the caller, and a test checks that each
# registered family's name contains one of these, so a new family adds its stem here.
FAMILY_STEMS = ("llava", "qwen", "gemma", "phi4", "phi-4", "phi_4")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings, or bare string statements (prose)."""
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)  # a lambda's is an expression
        for stmt in body if isinstance(body, list) else []:
            if (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                    and isinstance(stmt.value.value, str)):
                out.add(id(stmt.value))
    return out


def _identifiers(node: ast.AST) -> Iterator[str]:
    """The names a node spells in code."""
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, ast.alias):
        yield node.name
        yield node.asname or ""
    elif isinstance(node, ast.ImportFrom):
        yield node.module or ""
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    elif isinstance(node, ast.arg):
        yield node.arg
    elif isinstance(node, ast.keyword):
        yield node.arg or ""


def family_mentions(source: str, words: set[str], filename: str = "<module>") -> list[str]:
    """Each place a module's code names a family: "line: name X" or "line: string 'X'" (case-insensitive
    substring of any of `words`)."""
    tree = ast.parse(source, filename)
    prose = _docstrings(tree)
    lowered = {w.lower() for w in words}

    def names_one(text: str) -> bool:
        text = text.lower()
        return any(w in text for w in lowered)

    out = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        out += [f"{line}: name {name}" for name in _identifiers(node) if name and names_one(name)]
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
                and names_one(node.value)):
            out.append(f"{line}: string {node.value[:60]!r}")
    return sorted(set(out), key=lambda s: (int(s.split(":")[0]), s))
