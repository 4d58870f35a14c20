"""No function in the package is over ``MAX_LINES`` lines unless its docstring says why, on a line that
starts with ``Long:``: a long function is usually several steps that each deserve a name, and the rare
one that reads best whole (an algorithm as one loop) says so where a reader meets it."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "parablock_flwr"
MAX_LINES = 60

# Long functions whose split is under way elsewhere, each named with its path (none now).
# Each entry must still be long (test_pending_functions_are_still_long), so the list cannot go stale.
PENDING: set[str] = set()


def long_functions(source: str, path: str) -> dict[str, int]:
    """``PATH:Qualified.name`` -> lines (``def`` to its last line) of every function over ``MAX_LINES``
    whose docstring has no line starting with ``Long:``."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            named = isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            if named and not isinstance(child, ast.ClassDef):
                length = child.end_lineno - child.lineno + 1
                doc = ast.get_docstring(child) or ""
                if length > MAX_LINES and not any(line.strip().startswith("Long:") for line in doc.splitlines()):
                    found[f"{path}:{prefix}{child.name}"] = length
            visit(child, f"{prefix}{child.name}." if named else prefix)

    visit(ast.parse(source), "")
    return found


def package_long_functions() -> dict[str, int]:
    root = PACKAGE.parent
    found: dict[str, int] = {}
    for file in sorted(PACKAGE.rglob("*.py")):
        found.update(long_functions(file.read_text(), file.relative_to(root).as_posix()))
    return found


def test_no_long_function_without_a_reason():
    offenders = {name: n for name, n in package_long_functions().items() if name not in PENDING}
    listed = ", ".join(f"{name} ({n} lines)" for name, n in sorted(offenders.items()))
    assert not offenders, f"over {MAX_LINES} lines, with no 'Long:' line in the docstring saying why: {listed}"


def test_pending_functions_are_still_long():
    settled = sorted(PENDING - package_long_functions().keys())
    assert not settled, f"no longer over {MAX_LINES} lines without a reason (or gone): remove from PENDING: {settled}"


def function(name: str, body_lines: int, doc: str = "A function.") -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(body_lines))
    return f'def {name}():\n    """{doc}"""\n{body}'


def test_the_check_counts_def_to_last_line_and_reads_the_reason():
    source = "\n".join(
        [
            function("at_limit", MAX_LINES - 2),  # def + docstring + body = MAX_LINES
            function("over_limit", MAX_LINES - 1),
            function("over_with_reason", MAX_LINES, doc="The spec as one loop.\n\n    Long: splitting hides it."),
            function("reason_not_at_line_start", MAX_LINES, doc="Not Long: a reason."),
            "class Node:\n" + textwrap.indent(function("train", MAX_LINES), "    "),
            "def outer():\n" + textwrap.indent(function("inner", MAX_LINES), "    "),
        ]
    )
    assert long_functions(source, "m.py") == {
        "m.py:over_limit": MAX_LINES + 1,
        "m.py:reason_not_at_line_start": MAX_LINES + 2,
        "m.py:Node.train": MAX_LINES + 2,
        "m.py:outer": MAX_LINES + 3,
        "m.py:outer.inner": MAX_LINES + 2,
    }


# Underscored names that are public by convention: NamedTuple's field list, the stdlib's exit without cleanup.
PUBLIC_BY_CONVENTION = {"_fields", "_exit", "_replace", "_asdict"}


def private_reads(source: str, path: str) -> list[str]:
    """``PATH:LINE: expr`` for each private name this module reads of another: ``from m import _x``, or
    ``obj._x`` where ``obj`` is not ``self``/``cls`` and not a class this module defines (its own privates)."""
    tree = ast.parse(source)
    own = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            found += [f"{path}:{node.lineno}: from {module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]  # fmt: skip
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            target = node.value.id if isinstance(node.value, ast.Name) else None
            if node.attr not in PUBLIC_BY_CONVENTION and target not in {"self", "cls", *own}:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_names():
    """A name with a leading underscore is its module's (or its class's) own: another module that reads it
    depends on what its owner may change without a word. Ask the owner for a public name instead."""
    root = PACKAGE.parent
    found = [hit for file in sorted(PACKAGE.rglob("*.py"))
             for hit in private_reads(file.read_text(), file.relative_to(root).as_posix())]  # fmt: skip
    assert not found, "\n".join(found)


def test_the_private_names_check_sees_imports_and_attributes_but_not_a_modules_own():
    source = textwrap.dedent("""
        from .wire import _pack
        import torch

        class Offer:
            _fields = ()

            def check(self, other):
                return self._x, other._y, Offer._z, torch.nn.Module()._modules
        """)  # fmt: skip
    found = private_reads(source, "m.py")
    assert found == ["m.py:2: from .wire import _pack", "m.py:9: other._y", "m.py:9: torch.nn.Module()._modules"]
