"""Tasks and flows stay thin: each reads as a short sequence of calls, with no nested closures."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 50


def prefect_functions() -> list[tuple[str, ast.FunctionDef]]:
    found = []
    for path in sorted([*REPO.glob("tasks/**/*.py"), *REPO.glob("flows/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d).startswith(("task", "flow")) for d in node.decorator_list
            ):
                found.append((f"{path.relative_to(REPO)}:{node.name}", node))
    return found


def test_there_are_tasks_and_flows_to_check():
    names = [name for name, _ in prefect_functions()]
    assert "tasks/stages/rl/stage.py:rl_stage" in names and "flows/rlhf_pipeline.py:rlhf_pipeline" in names


@pytest.mark.parametrize("name, node", prefect_functions(), ids=lambda x: x if isinstance(x, str) else "")
def test_a_task_or_flow_is_short_and_has_no_nested_functions(name, node):
    length = node.end_lineno - node.lineno + 1
    assert length <= MAX_LINES, f"{name} is {length} lines; move steps into named functions or the reporter"
    nested = [n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n is not node]
    assert not nested, f"{name} defines {nested} inside it; make them module-level functions or reporter methods"
