"""The tests mirror the source: one test module per rlhf_core module (pure code tested without a flow), and the
tests of tasks in the folder of what they test.

rlhf_core/<package>/<module>.py is tested in tests/rlhf_core/<package>/test_<module>.py (rlhf_core/rl_math.py in
tests/rlhf_core/test_rl_math.py). A test of tasks/<package>/ sits in tests/tasks/<package>/ (a stage's runs in the
pipeline beside its task: tests/tasks/stages/rl/ for the RL stage), sharing tests/tasks/conftest.py's `cfg`.
Cross-module tests live in tests/integration/ and tests/distributed/, the pipeline flow, the CLI, promotion,
retraining and the UI (end to end) in tests/flows/.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "rlhf_core"
TESTS = REPO / "tests" / "rlhf_core"
TASK_TESTS = REPO / "tests" / "tasks"

# modules without a test module of their own, each with the reason
EXEMPT = {
    "__init__.py": "package markers, no code",
    "config/__init__.py": "re-exports the config package (its lazy `reference` attributes are used by test_reference.py)",
    "rollout/vllm_process/rlhf_vllm_worker.py": "runs inside the vLLM server's own environment: tested through a server "
    "in tests/rlhf_core/rollout/test_vllm_server.py (weights pushed, the tied output layer repacked)",
}


def source_modules() -> list[str]:
    return sorted(str(p.relative_to(SOURCE)) for p in SOURCE.rglob("*.py") if "__pycache__" not in p.parts)


def expected_test(module: str) -> Path:
    path = Path(module)
    return TESTS / path.parent / f"test_{path.name}"


def test_every_rlhf_core_module_has_its_test_module():
    missing = [
        f"{m} -> {expected_test(m).relative_to(REPO)}"
        for m in source_modules()
        if Path(m).name not in EXEMPT and m not in EXEMPT and not expected_test(m).is_file()
    ]
    assert not missing, "rlhf_core modules without a test module: " + ", ".join(missing)


def test_every_test_module_names_a_source_module():
    modules = {str(expected_test(m).relative_to(TESTS)) for m in source_modules()}
    strays = sorted(
        str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py") if str(p.relative_to(TESTS)) not in modules
    )
    assert not strays, (
        f"tests/rlhf_core modules that mirror no rlhf_core module: {strays} (cross-module tests: tests/integration/)"
    )


def test_the_exemptions_are_still_needed():
    stale = [m for m in EXEMPT if "/" in m and not (SOURCE / m).is_file()]
    assert not stale, f"exempted modules that no longer exist: {stale}"


def test_every_tasks_test_sits_in_a_folder_of_tasks():
    strays = sorted(
        str(p.relative_to(REPO))
        for p in TASK_TESTS.rglob("test_*.py")
        if not (REPO / "tasks" / p.parent.relative_to(TASK_TESTS)).is_dir()
    )
    assert not strays, f"tests/tasks modules in a folder that tasks/ does not have: {strays}"
