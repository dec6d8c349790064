"""The sizes that keep the code readable: a folder of rlhf_core/ or tasks/ holds at most 12 modules, a class at
most 150 lines, a function at most 80 (its nested functions counted in it) and 8 parameters (`self` aside, `*args`
and `**kwargs` one each: more is one object's worth), a module at most 400 and a test file at most 500. Prefect
tasks and flows have their own, tighter limit (tests/tasks/test_thin_tasks.py)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("rlhf_core", "tasks", "flows")
MAX_MODULES, MAX_CLASS, MAX_FUNCTION, MAX_MODULE, MAX_TEST_FILE = 12, 150, 80, 400, 500
MAX_PARAMETERS = 8


def source_files() -> list[Path]:
    return sorted(p for name in PACKAGES for p in (REPO / name).rglob("*.py") if "__pycache__" not in p.parts)


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def outermost_functions(tree: ast.AST):
    """Module-level functions and methods; a nested function is part of its parent, not a function of its own."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from outermost_functions(node)


def test_no_folder_holds_more_than_twelve_modules():
    folders = {p.parent for p in source_files() if p.parts[len(REPO.parts)] in ("rlhf_core", "tasks")}
    crowded = {
        str(d.relative_to(REPO)): n
        for d in folders
        if (n := sum(1 for p in d.glob("*.py") if p.name != "__init__.py")) > MAX_MODULES
    }
    assert not crowded, f"folders over {MAX_MODULES} modules (split them into packages): {crowded}"


def test_classes_functions_and_modules_stay_short():
    too_long = []
    for path in source_files():
        text = path.read_text()
        name = str(path.relative_to(REPO))
        if len(text.splitlines()) > MAX_MODULE:
            too_long.append(f"{name}: {len(text.splitlines())} lines (module)")
        tree = ast.parse(text)
        too_long += [
            f"{name}:{n.name}: {lines(n)} lines (class)"
            for n in ast.walk(tree)
            if isinstance(n, ast.ClassDef) and lines(n) > MAX_CLASS
        ]
        too_long += [
            f"{name}:{n.name}: {lines(n)} lines (function)"
            for n in outermost_functions(tree)
            if lines(n) > MAX_FUNCTION
        ]
    assert not too_long, "over the limits: " + "; ".join(too_long)


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_function_takes_more_than_eight_parameters():
    crowded = [
        f"{p.relative_to(REPO)}:{n.lineno} {n.name} ({parameters(n)})"
        for p in source_files()
        for n in ast.walk(ast.parse(p.read_text()))
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and parameters(n) > MAX_PARAMETERS
    ]
    assert not crowded, f"functions over {MAX_PARAMETERS} parameters (pass one object): {crowded}"


def test_test_files_stay_short():
    long_files = {
        str(p.relative_to(REPO)): n
        for p in (REPO / "tests").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_TEST_FILE
    }
    assert not long_files, f"test files over {MAX_TEST_FILE} lines: {long_files}"


def test_the_limits_catch_what_they_name():
    nested = ast.parse("def f():\n" + "    x = 1\n" * 70 + "    def g():\n" + "        y = 2\n" * 20)
    assert [lines(n) for n in outermost_functions(nested)] == [92]  # g counts in f, and is not listed itself
    (method,) = ast.parse("class C:\n    def m(self, a, b=1, *rest, c, **more): ...").body[0].body
    assert parameters(method) == 5
