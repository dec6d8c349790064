"""What README.md, ARCHITECTURE.md and docs/ say about the code, checked against the code: every backticked
config name (`section.field`) is a field of PipelineConfig; the README's test count is within 10% of the
suite's; deployments/prefect.yaml names the Prefect release pyproject.toml pins; docs/deployments.md lists
every deployment of that file; the number of import-linter contracts the pages name is pyproject.toml's; and
no page speaks of how the work was planned."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from rlhf_core.config.pipeline import PipelineConfig
from rlhf_core.config.reference import describe_fields
from tests.test_docs import CODE_SPAN, prose_lines

REPO = Path(__file__).resolve().parents[1]
# docs/configuration.md is generated from the fields themselves (tests/rlhf_core/config/test_reference.py)
PAGES = [REPO / "README.md", REPO / "ARCHITECTURE.md"] + [
    p for p in sorted((REPO / "docs").glob("*.md")) if p.name != "configuration.md"
]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DEPLOYMENTS = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())

# backticked names that start like a config section but are something else, each with what it is
NOT_CONFIG = {
    "guard.passed": "a registered version's tag (docs/registry.md)",
    "guard.broken": "a registered version's tag (docs/registry.md)",
    "guard.rollback": "the RL stage run's tag guard.rollback.<n> after a rollback (docs/registry.md)",
    "guard.stopped": "the RL stage run's tag after a guard stop (docs/registry.md)",
    "model.generate": "transformers' method, the rollout's speed anchor",
    "model.safetensors": "a checkpoint's weights file",
    "registry.example.com": "a container registry's host name in an example (docs/image.md)",
    "promote.metric": "a retired field, named by the error that says what replaced it (docs/troubleshooting.md)",
    "promote.min_improvement": "a retired field, named by the error that says what replaced it",
}
SECTIONS = "|".join(sorted(PipelineConfig.model_fields, key=len, reverse=True))
# a section name, not inside a longer dotted or path-like word, then .field, [] or [i] parts
CONFIG_NAME = re.compile(rf"(?<![\w./:@<>-])(?:{SECTIONS})(?:\.\w+|\[\]|\[\d+\])+")
# how README.md's `rlhf deploy` row names each deployment of deployments/prefect.yaml
README_DEPLOYMENT_WORDS = {
    "default": "the pipeline",
    "ray": "Ray cluster",
    "nightly": "nightly",
    "every-5-minutes": "feedback watch",
    "on-feedback": "retraining on feedback",
    "manual": "promotion",
}
NUMBER_WORDS = {w: n for n, w in enumerate("zero one two three four five six seven eight nine ten".split())}


def config_names() -> set[str]:
    """Every field of PipelineConfig (`grpo.rewards[].weight` for a list's entries) and every section above one."""
    names = set()
    for path, _, _ in describe_fields():
        parts = path.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return names


def unknown_config_names(page: Path, known: set[str]) -> list[str]:
    """The backticked config-like names of `page` (outside fenced blocks) that are neither fields nor allowed."""
    found = []
    for line in prose_lines(page.read_text()):
        for span in CODE_SPAN.finditer(line):
            for match in CONFIG_NAME.finditer(span.group(0).strip("`")):
                name = re.sub(r"\[\d+\]", "[]", match.group(0))
                if name not in known and name not in NOT_CONFIG:
                    found.append(name)
    return found


def test_backticked_config_names_are_fields():
    known = config_names()
    problems = {str(p.relative_to(REPO)): sorted(set(unknown_config_names(p, known))) for p in PAGES}
    problems = {page: names for page, names in problems.items() if names}
    assert not problems, (
        f"config names that are not fields of PipelineConfig (`.venv/bin/rlhf fields` lists them; a name that "
        f"is not a config field goes in NOT_CONFIG with what it is): {problems}"
    )


def test_the_config_name_check_sees_a_wrong_name(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "Set `run.save_steps` and `rl.save_steps`, `--set reward.max_step=3` and `grpo.rewards[0].weight`;\n"
        "`rlhf_core.rl.ppo` and `configs/demo.yaml` are not config names, `objective/kl` a metric.\n"
        "```yaml\nrun: {bogus.field: 1}   # `run.bogus` in a fenced block\n```\n"
    )
    assert unknown_config_names(page, config_names()) == ["run.save_steps", "reward.max_step"]


def test_every_allowed_name_is_still_in_a_page_and_not_a_field():
    known, text = config_names(), "\n".join(p.read_text() for p in PAGES)
    stale = [name for name in NOT_CONFIG if name in known or name not in text]
    assert not stale, f"NOT_CONFIG names that are config fields now, or that no page names any more: {stale}"


def readme_test_counts() -> list[int]:
    """Every 'about N tests' figure of README.md and docs/development.md."""
    text = (REPO / "README.md").read_text() + (REPO / "docs" / "development.md").read_text()
    return [int(n.replace(",", "")) for n in re.findall(r"\babout ([\d,]+) tests\b", " ".join(text.split()))]


@pytest.mark.slow  # collects the whole suite in a subprocess: about 30 s on 2 cores
def test_the_readme_test_count_is_within_ten_percent():
    figures = readme_test_counts()
    assert figures, "README.md says the suite's size as 'about N tests'"
    collect = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not chaos"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    counted = re.search(r"(\d+)(?:/\d+)? tests? collected", collect.stdout)
    assert counted, f"pytest --collect-only printed no count:\n{collect.stdout[-2000:]}{collect.stderr[-2000:]}"
    total = int(counted.group(1))
    off = [n for n in figures if abs(n - total) > 0.1 * total]
    assert not off, f"the pages say about {off} tests; the suite has {total} (`make test` runs every test but chaos)"


def test_prefect_yaml_names_the_pinned_prefect():
    pins = [d for d in PYPROJECT["project"]["dependencies"] if re.match(r"prefect\b", d)]
    assert len(pins) == 1, pins
    lowest = re.search(r">=\s*([\d.]+)", pins[0])
    assert lowest, f"pyproject.toml pins prefect as {pins[0]!r}, with no lowest release"
    assert str(DEPLOYMENTS["prefect-version"]) == lowest.group(1), (
        f"deployments/prefect.yaml says prefect-version {DEPLOYMENTS['prefect-version']}, "
        f"pyproject.toml pins {pins[0]!r}"
    )


def test_docs_deployments_lists_every_deployment():
    flows = {
        "flows/rlhf_pipeline.py": "rlhf-pipeline",
        "flows/retrain.py": "rlhf-retrain",
        "flows/promote.py": "rlhf-promote",
        "flows/feedback_watch.py": "rlhf-feedback-watch",
    }
    text = (REPO / "docs" / "deployments.md").read_text()
    named = [f"{flows[d['entrypoint'].split(':')[0]]}/{d['name']}" for d in DEPLOYMENTS["deployments"]]
    missing = [n for n in named if f"`{n}`" not in text]
    assert not missing, f"docs/deployments.md's table does not name {missing} (deployments/prefect.yaml has them)"
    readme_row = next(line for line in (REPO / "README.md").read_text().splitlines() if "rlhf deploy`" in line)
    unsaid = [
        d["name"] for d in DEPLOYMENTS["deployments"] if README_DEPLOYMENT_WORDS.get(d["name"], "?") not in readme_row
    ]
    assert not unsaid, f"README.md's `rlhf deploy` row does not name the deployments {unsaid} (README_DEPLOYMENT_WORDS)"


def test_the_number_of_import_linter_contracts():
    contracts = len(PYPROJECT["tool"]["importlinter"]["contracts"])
    said = [
        (page.name, word)
        for page in PAGES
        for word in re.findall(r"\b(\w+) import-linter contracts\b", " ".join(page.read_text().split()))
        if word.lower() in NUMBER_WORDS
    ]
    assert said, "no page says how many import-linter contracts there are (docs/development.md's make lint row)"
    wrong = [(page, word) for page, word in said if NUMBER_WORDS[word.lower()] != contracts]
    assert not wrong, f"pyproject.toml has {contracts} import-linter contracts; the pages say {wrong}"


PLANNING = re.compile(r"\blent\b|\bissues? \[|\bthe issue's\b|\bsessions?\b", re.IGNORECASE)


def planning_words(page: Path) -> list[str]:
    """The planning words of `page`'s prose (code spans and fenced blocks left out)."""
    return [m.group(0) for line in prose_lines(page.read_text()) for m in PLANNING.finditer(CODE_SPAN.sub("", line))]


def test_no_page_speaks_of_how_the_work_was_planned():
    found = {str(page.relative_to(REPO)): planning_words(page) for page in PAGES}
    found = {page: words for page, words in found.items() if words}
    assert not found, f"say what was run and what was not, not how the work was planned: {found}"


def test_the_planning_check_sees_planning_words(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("No GPU was lent to the session; target (issue [6/6]).\nRay's `session_latest` is a path.\n")
    assert planning_words(page) == ["lent", "session", "issue ["]
