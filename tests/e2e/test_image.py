"""The container image (Dockerfile, .dockerignore, `make image`, docs/image.md) against the project: every build
argument declared where it is used, torch pinned as the Makefile pins it and installed first, the project
installed non-editable with its `ray` extra at pyproject.toml's version, the tags `make image` prints for each
DEVICE and builder, what the build context leaves out, the image named in deployments/prefect.yaml (read by
Prefect's own loader) with the deployment docs/image.md shows, and the Dockerfile's install steps resolved
against the registries in a clean venv (`uv pip install --dry-run`: metadata only, about 10 s).

Nothing here builds the image: CI's machine has no container builder. docs/image.md says how it was built here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
MAKE = shutil.which("make")
REF = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
BASE_ENVIRONMENT = {"PATH"}  # what every base image sets and the Dockerfile may extend


# the Dockerfile, read as a builder reads it ---------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) per logical line: a backslash-newline joins lines (the two characters
    removed, as builders do), comment lines are dropped, also inside a continued instruction."""
    out, pending = [], None
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (pending is None and not line.strip()):
            continue
        joined = (pending or "") + line
        if joined.rstrip().endswith("\\"):
            pending = joined.rstrip()[:-1]
            continue
        pending = None
        keyword, _, arguments = joined.strip().partition(" ")
        out.append((keyword.upper(), arguments.strip()))
    assert pending is None, "the Dockerfile ends inside a continued instruction"
    return out


def declared_arguments(text: str) -> list[tuple[str, str | None, bool]]:
    """(name, default or None, declared before the first FROM) for every ARG."""
    out, before_from = [], True
    for keyword, arguments in instructions(text):
        if keyword == "FROM":
            before_from = False
        elif keyword == "ARG":
            name, eq, default = arguments.partition("=")
            out.append((name.strip(), default.strip().strip('"') if eq else None, before_from))
    return out


def default(name: str) -> str:
    found = [d for n, d, _ in declared_arguments(DOCKERFILE) if n == name and d is not None]
    assert len(found) == 1, f"the Dockerfile gives ARG {name} {len(found)} defaults"
    return found[0]


def scope_problems(text: str) -> list[str]:
    """What a builder would expand to nothing: a variable used where no ARG or ENV declares it (an ARG declared
    above FROM is seen by FROM lines only, until a stage declares it again); and an ARG that nothing uses."""
    problems, global_args, stage, used = [], set(), None, set()
    for keyword, arguments in instructions(text):
        names = REF.findall(arguments.partition("=")[2] if keyword == "ARG" else arguments)
        used.update(names)
        visible = global_args if stage is None else stage
        problems += [f"{keyword} {arguments[:60]}: ${n} is not declared here" for n in names if n not in visible]
        if keyword == "FROM":
            stage = set(BASE_ENVIRONMENT)
        elif keyword == "ARG":
            visible.add(arguments.partition("=")[0].strip())
        elif keyword == "ENV":
            stage.update(re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", arguments))
    declared = {name for name, _, _ in declared_arguments(text)}
    return problems + [f"ARG {n} is never used" for n in sorted(declared - used)]


def run_lines() -> list[str]:
    return [arguments for keyword, arguments in instructions(DOCKERFILE) if keyword == "RUN"]


def pip_install_specs() -> list[str]:
    """The requirement of each `pip install` in the Dockerfile's RUN lines, in order, with the ARG defaults."""
    commands = [command for line in run_lines() for command in re.findall(r"pip install ([^&;]*)", line)]
    requirements = [re.findall(r'"([^"]*)"', command)[-1] for command in commands]  # the last quoted word
    return [re.sub(r"\$\{(\w+)\}", lambda m: default(m.group(1)), r) for r in requirements]


def test_the_dockerfile_reader_sees_undeclared_and_unused_arguments():
    text = (
        "ARG BASE=debian\nFROM ${BASE}\n# RUN echo $COMMENTED\nARG USED=1\nARG UNUSED=2\n"
        'RUN echo ${USED} \\\n    $MISSING && echo "${BASE}"\nENV PATH=/x:$PATH\n'
    )
    assert instructions(text)[4] == ("RUN", 'echo ${USED}     $MISSING && echo "${BASE}"')
    assert scope_problems(text) == [
        'RUN echo ${USED}     $MISSING && echo "${BASE}": $MISSING is not declared here',
        'RUN echo ${USED}     $MISSING && echo "${BASE}": $BASE is not declared here',
        "ARG UNUSED is never used",
    ]


def test_every_build_argument_is_declared_where_it_is_used():
    assert scope_problems(DOCKERFILE) == []


def test_torch_is_pinned_as_in_the_makefile_and_installed_before_the_project():
    makefile_pins = set(re.findall(r"torch==([0-9][\w.]*)", (REPO / "Makefile").read_text()))
    assert makefile_pins == {default("TORCH_VERSION")}
    assert default("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"  # the CPU build by default
    specs = pip_install_specs()
    assert specs == [f"pip=={default('PIP_VERSION')}", f"torch=={default('TORCH_VERSION')}", ".[ray]"]
    torch_line = next(line for line in run_lines() if '"torch==' in line)
    assert '--index-url "${TORCH_INDEX_URL}"' in torch_line


def test_the_project_is_installed_non_editable_with_the_ray_extra_at_its_version():
    project_line = next(line for line in run_lines() if '".[ray]"' in line)
    assert not re.search(r"\s(-e|--editable)\b", project_line)
    assert PYPROJECT["project"]["optional-dependencies"]["ray"] == ["ray[default,train]==2.60.0"]
    assert default("VERSION") == VERSION
    labels = " ".join(arguments for keyword, arguments in instructions(DOCKERFILE) if keyword == "LABEL")
    assert 'org.opencontainers.image.version="${VERSION}"' in labels
    # the build stops unless the version installed is the one the labels name
    assert any("version('rlhf-pipeline')" in line and "${VERSION}" in line for line in run_lines())


def test_the_image_runs_as_a_user_in_runs_with_no_secret_and_no_forced_offline_hub():
    steps = instructions(DOCKERFILE)
    users = [arguments for keyword, arguments in steps if keyword == "USER"]
    assert users and re.fullmatch(r"[1-9][0-9]*(:[0-9]+)?", users[-1]), users  # numeric: runAsNonRoot checks it
    assert [arguments for keyword, arguments in steps if keyword == "WORKDIR"][-1] == "/runs"
    settings = " ".join(arguments for keyword, arguments in steps if keyword in ("ENV", "ARG"))
    assert "HF_HUB_OFFLINE" not in settings
    assert not re.search(r"TOKEN|PASSWORD|SECRET|API_KEY|CREDENTIAL", settings, re.IGNORECASE)


# make image ------------------------------------------------------------------------------------------------------


def make_image(*args: str, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"PATH": path} if path is not None else {})}
    return subprocess.run(
        [MAKE, "--no-print-directory", "-n", "image", *args], cwd=REPO, env=env, capture_output=True, text=True
    )


def build_command(output: str) -> str:
    lines = output.replace("\\\n", " ").splitlines()
    found = [line for line in lines if " build -f Dockerfile " in line]
    assert len(found) == 1, output
    return found[0]


@pytest.mark.parametrize(
    ("device", "tag", "device_args"),
    [
        ("cpu", f"rlhf-pipeline:{VERSION}", []),
        (
            "cuda",
            f"rlhf-pipeline:{VERSION}-cuda",
            ["--build-arg BASE_IMAGE=nvidia/cuda:", "--build-arg TORCH_INDEX_URL=https://pypi.org/simple"],
        ),
    ],
)
def test_make_image_tags_each_device_with_the_version(device, tag, device_args):
    done = make_image(f"DEVICE={device}", "BUILDER=docker")
    assert done.returncode == 0, done.stderr
    command = build_command(done.stdout)
    assert command.startswith("docker build -f Dockerfile ") and command.rstrip().endswith(" .")
    assert f" -t {tag} " in command
    assert f"--build-arg VERSION={VERSION} " in command and f"--build-arg DEVICE={device} " in command
    for expected in device_args:
        assert expected in command
    assert ("nvidia/cuda" in command) == (device == "cuda")


def fake_path(tmp_path: Path, builders: list[str]) -> str:
    """A PATH with the tools the recipe needs (sed, git) and the named builders as stand-ins, nothing more."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sed", "git"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    for builder in builders:
        (bin_dir / builder).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / builder).chmod(0o755)
    return str(bin_dir)


def test_make_image_takes_the_first_builder_found(tmp_path):
    done = make_image(path=fake_path(tmp_path, ["buildah", "docker"]))
    assert done.returncode == 0, done.stderr
    assert build_command(done.stdout).startswith("docker build ")  # podman, then docker, then buildah


def test_make_image_without_a_builder_or_with_an_unknown_device_says_so_in_one_line(tmp_path):
    no_builder = subprocess.run(
        [MAKE, "--no-print-directory", "image"],
        cwd=REPO,
        env={**os.environ, "PATH": fake_path(tmp_path, [])},
        capture_output=True,
        text=True,
    )
    assert no_builder.returncode != 0
    first = no_builder.stderr.splitlines()[0]
    assert first.startswith("make image: no container builder found") and all(
        tool in first for tool in ("podman", "docker", "buildah")
    )
    bad_device = subprocess.run(
        [MAKE, "--no-print-directory", "image", "DEVICE=gpu", "BUILDER=true"], cwd=REPO, capture_output=True, text=True
    )
    assert bad_device.returncode != 0
    assert bad_device.stderr.splitlines()[0] == "make image: DEVICE is cpu or cuda, not 'gpu'"


# the build context -----------------------------------------------------------------------------------------------


def ignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def pattern_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern: `**` any number of directories, `*` and `?` within one path element."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out += {"*": "[^/]*", "?": "[^/]"}.get(pattern[i], re.escape(pattern[i]))
            i += 1
    return re.compile(out)


def left_out(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or a directory above it decides, `!` lets back in."""
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern in patterns:
        regex = pattern_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            result = not pattern.startswith("!")
    return result


def test_the_ignore_rule_reader_follows_docker():
    patterns = ["*", "!src", "**/__pycache__", "!src/keep.pyc", "*.log"]
    assert left_out("README.md", patterns) and not left_out("src/a/b.py", patterns)
    assert left_out("src/a/__pycache__/b.pyc", patterns) and left_out("x.log", patterns)
    assert not left_out("src/keep.pyc", patterns) and not left_out("src/x.log", patterns)


def test_the_build_context_holds_what_the_dockerfile_copies_and_nothing_of_a_run():
    patterns = ignore_patterns()
    copied = [
        source
        for keyword, arguments in instructions(DOCKERFILE)
        if keyword == "COPY"
        for source in arguments.split()[:-1]
    ]
    assert {"pyproject.toml", "README.md", "rlhf_core", "tasks", "flows", "configs"} <= set(copied)
    kept = [p for p in [*copied, "rlhf_core/rl/step.py", "configs/demo.yaml", "flows/cli.py"] if left_out(p, patterns)]
    assert not kept, f".dockerignore leaves out what the Dockerfile copies: {kept}"
    run_files = [
        ".venv/bin/python",
        ".venv-vllm/bin/python",
        "mlruns/0/meta.yaml",
        "mlflow.db",
        "mlflow.db.rlhf-create.lock",
        "outputs/demo/sft/model.safetensors",
        ".git/HEAD",
        ".ruff_cache/x",
        ".pytest_cache/v/x",
        "rlhf_core/__pycache__/rl_math.cpython-311.pyc",
        "rlhf_pipeline.egg-info/PKG-INFO",
        ".env",
        "tests/test_docs.py",
        "bench/results/rlvr.md",
    ]
    assert [p for p in run_files if not left_out(p, patterns)] == []


# Prefect's Docker and Kubernetes work pools ---------------------------------------------------------------------


def prefect_deployments(text: str, tmp_path: Path) -> list[dict]:
    from prefect.cli.deploy._config import _load_deploy_configs_and_actions
    from rich.console import Console

    file = tmp_path / "prefect.yaml"
    file.write_text(text)
    configs, _ = _load_deploy_configs_and_actions(prefect_file=file, console=Console(file=open(os.devnull, "w")))
    return configs


def documented_container_deployment() -> str:
    page = (REPO / "docs" / "image.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", page, re.DOTALL) if b.startswith("  - name: container")]
    assert len(blocks) == 1, "docs/image.md shows the container deployment in one ```yaml block"
    return blocks[0]


def test_prefect_yaml_names_the_image_and_keeps_its_deployments(tmp_path):
    text = (REPO / "deployments" / "prefect.yaml").read_text()
    configs = prefect_deployments(text, tmp_path)
    assert [c["name"] for c in configs] == ["default", "ray", "nightly", "every-5-minutes", "on-feedback", "manual"]
    assert {c["work_pool"]["name"] for c in configs} == {"rlhf-process"}  # what `rlhf deploy` creates
    container = yaml.safe_load(text)["definitions"]["container"]
    assert container["work_pool"]["job_variables"]["image"] == f"rlhf-pipeline:{VERSION}"
    workdir = [arguments for keyword, arguments in instructions(DOCKERFILE) if keyword == "WORKDIR"][-1]
    assert container["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": workdir}}]


def test_the_documented_container_deployment_loads_and_runs_the_installed_flow(tmp_path):
    from prefect.flows import load_flow_from_entrypoint

    text = (REPO / "deployments" / "prefect.yaml").read_text().rstrip("\n") + "\n\n" + documented_container_deployment()
    configs = {c["name"]: c for c in prefect_deployments(text, tmp_path)}
    container = configs["container"]
    assert container["work_pool"]["job_variables"]["image"] == f"rlhf-pipeline:{VERSION}"
    assert container["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == "/runs"
    # a module, not a file: in the image the flows are the installed package, and /runs holds no source
    assert not container["entrypoint"].split(":")[0].endswith(".py")
    assert load_flow_from_entrypoint(container["entrypoint"]).name == "rlhf-pipeline"
    # the config is where the Dockerfile copies configs/ to
    workdirs = [arguments for keyword, arguments in instructions(DOCKERFILE) if keyword == "WORKDIR"]
    source_dir = PurePosixPath(workdirs[0])
    assert "configs ./configs" in [arguments for keyword, arguments in instructions(DOCKERFILE) if keyword == "COPY"]
    config = PurePosixPath(container["parameters"]["config_path"])
    assert (REPO / config.relative_to(source_dir)).is_file()


# the install steps, resolved --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_dockerfiles_install_steps_resolve_in_a_clean_venv(tmp_path):
    """Every `pip install` of the Dockerfile, resolved together for a fresh Python 3.11 venv against PyPI with
    uv (metadata only; pip would download every wheel, GBs). PyPI's torch stands in for the CPU build of
    download.pytorch.org, which this machine cannot reach: the same version, its dependencies a superset."""
    uv = Path(sys.executable).with_name("uv")
    assert uv.is_file(), "make venv installs uv into .venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    done = subprocess.run(
        [str(uv), "pip", "install", "--dry-run", "--python", str(tmp_path / "venv" / "bin" / "python")]
        + pip_install_specs(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    planned = set(re.findall(r"^ \+ (\S+)", done.stdout + done.stderr, re.MULTILINE))
    expected = {f"pip=={default('PIP_VERSION')}", f"torch=={default('TORCH_VERSION')}", "ray==2.60.0"}
    assert expected <= planned, sorted(planned)
    assert any(p.startswith("rlhf-pipeline") for p in planned)
