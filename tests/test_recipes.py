"""docs/ray.md's KubeRay and SLURM recipes, checked mechanically.

Every YAML block of the docs that concern Ray and every manifest under deployments/kuberay/ parses; a manifest holds
only the fields its kind has (the RayCluster against KubeRay's CRD, pod templates against a short list of core
Kubernetes fields: tests/fixtures/kuberay_crd.py); nothing a manifest names is undefined (a claim, a ConfigMap, a
Secret, a volume, the Prefect pool and the deployment that uses it); the head's second container, which runs the
flow as Ray's driver, has the address and the token and shares the head's processes and /tmp/ray; the Ray containers
bring probes that need no wget; the image is the pinned tag that `make image DEVICE=cuda` builds; every shell block
and script passes `bash -n`. A YAML block that names a file after its language (```yaml
deployments/kuberay/raycluster.yaml) is an excerpt of that file, word for word. The SLURM script itself runs in
tests/test_slurm_recipe.py.
"""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

from tests.fixtures.kuberay_crd import SCHEMAS

REPO = Path(__file__).resolve().parents[1]
KUBERAY = REPO / "deployments" / "kuberay"
SCRIPTS = sorted((REPO / "deployments" / "slurm").glob("*.sbatch"))
PYPROJECT = (REPO / "pyproject.toml").read_text()
VERSION = re.search(r'^version = "([^"]+)"', PYPROJECT, re.MULTILINE).group(1)
RAY_VERSION = re.search(r"ray\[[^\]]*\]==([\d.]+)", PYPROJECT).group(1)
KUBERAY_MIN = (1, 5, 1)  # the first release with RayCluster.spec.authOptions
HELM_REPO = "helm repo add kuberay https://ray-project.github.io/kuberay-helm/"
BLOCK = re.compile(r"^```(\w+)[ \t]*([^\n`]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
RAY_WORDS = re.compile(r"\b(ray|RayCluster|kuberay|kubectl|helm|srun|sbatch)\b")


# what the recipes hold ----------------------------------------------------------------------------------------


def ray_pages() -> list[Path]:
    """docs/ray.md, and every other page with a YAML or shell block about Ray, Kubernetes or SLURM."""
    pages = sorted((REPO / "docs").glob("*.md"))
    return [p for p in pages if p.name == "ray.md" or any(RAY_WORDS.search(b[2]) for b in BLOCK.findall(p.read_text()))]


def blocks(language: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(where, the file named after the language or '', text) of every such fenced block of those pages."""
    return [
        (f"{page.relative_to(REPO)} block {n}", named.strip(), text)
        for page in ray_pages()
        for n, (lang, named, text) in enumerate(BLOCK.findall(page.read_text()), 1)
        if lang in language
    ]


def yaml_blocks() -> list[tuple[str, str, str]]:
    return blocks(("yaml", "yml"))


def shell_blocks() -> list[tuple[str, str, str]]:
    return blocks(("bash", "sh", "shell"))


def manifests() -> list[tuple[str, dict]]:
    """(where, document) of every manifest: the files under deployments/kuberay/ and whole manifests in the docs."""
    found = [
        (str(f.relative_to(REPO)), d) for f in sorted(KUBERAY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())
    ]
    for where, _, text in yaml_blocks():
        found += [(where, d) for d in documents(text) if isinstance(d, dict) and "kind" in d]
    return found


def documents(text: str) -> list:
    """The YAML documents of a block; none when it does not parse (`parse_problems` reports that)."""
    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return []


# the checks: each returns the problems it found --------------------------------------------------------------


def parse_problems(where: str, text: str) -> list[str]:
    try:
        list(yaml.safe_load_all(text))
    except yaml.YAMLError as err:
        return [f"{where}: not YAML: {err}".splitlines()[0]]
    return []


def excerpt_problems(where: str, named: str, text: str) -> list[str]:
    """A block that names a file is a run of that file's lines (as indented there, or all dedented alike)."""
    if not named:
        return []
    file = REPO / named
    if not file.is_file():
        return [f"{where}: names {named}, which does not exist"]
    lines = [line.rstrip() for line in text.strip("\n").splitlines()]
    source = [line.rstrip() for line in file.read_text().splitlines()]
    for start in range(len(source) - len(lines) + 1):
        window = source[start : start + len(lines)]
        shift = len(window[0]) - len(window[0].lstrip()) - (len(lines[0]) - len(lines[0].lstrip()))
        if shift >= 0 and all(w == " " * shift + line if line else not w for w, line in zip(window, lines)):
            return []
    return [f"{where}: not an excerpt of {named} (the block and the file have drifted apart)"]


def schema_problems(where: str, doc: dict) -> list[str]:
    schema = SCHEMAS.get(doc.get("kind"))
    if schema is None:
        return [f"{where}: a {doc.get('kind')} is not a kind this test knows: add its schema"]
    return [
        f"{where}: {doc['kind']} {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
        for e in Draft202012Validator(schema).iter_errors(doc)
    ]


def pods(cluster: dict) -> list[tuple[str, dict]]:
    spec = cluster.get("spec", {})
    head = [("head", spec.get("headGroupSpec", {}).get("template", {}).get("spec", {}))]
    return head + [
        (f"group {g.get('groupName')}", g.get("template", {}).get("spec", {})) for g in spec.get("workerGroupSpecs", [])
    ]


def env_value(container: dict, name: str):
    return next((e.get("value", e.get("valueFrom")) for e in container.get("env", []) if e.get("name") == name), None)


def reference_problems(docs: list[tuple[str, dict]], shell_text: str) -> list[str]:
    """Every claim, ConfigMap, Secret and volume a RayCluster names is defined; its images are the pinned CUDA tag."""
    defined = {(d.get("kind"), d.get("metadata", {}).get("name")): d for _, d in docs}
    secrets = set(re.findall(r"kubectl create secret generic ([\w.-]+)", shell_text))
    image = re.compile(rf"^[\w.-]+(:\d+)?(/[\w.-]+)*/rlhf-pipeline:{re.escape(VERSION)}-cuda$")
    problems = []
    for where, cluster in ((w, d) for w, d in docs if d.get("kind") == "RayCluster"):
        name, spec = cluster["metadata"]["name"], cluster["spec"]
        token = name if spec.get("authOptions", {}).get("mode") == "token" else None  # KubeRay's Secret, key auth_token
        if spec.get("rayVersion") != RAY_VERSION:
            problems.append(f"{where}: rayVersion {spec.get('rayVersion')} is not the Ray pinned here ({RAY_VERSION})")
        for pod_name, pod in pods(cluster):
            at = f"{where} ({pod_name})"
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            for volume in volumes.values():
                claim = volume.get("persistentVolumeClaim", {}).get("claimName")
                pvc = defined.get(("PersistentVolumeClaim", claim))
                if claim and pvc is None:
                    problems.append(f"{at}: the claim {claim} is defined nowhere")
                elif claim and "ReadWriteMany" not in pvc["spec"].get("accessModes", []):
                    problems.append(f"{at}: the claim {claim} is not ReadWriteMany")
            for c in pod.get("containers", []):
                cat = f"{at} container {c.get('name')}"
                if not image.match(c.get("image", "")):
                    problems.append(f"{cat}: image {c.get('image')} is not <registry>/rlhf-pipeline:{VERSION}-cuda")
                problems += [
                    f"{cat}: mounts {m['name']}, which is no volume of the pod"
                    for m in c.get("volumeMounts", [])
                    if m["name"] not in volumes
                ]
                for source in c.get("envFrom", []):
                    if "configMapRef" in source and ("ConfigMap", source["configMapRef"]["name"]) not in defined:
                        problems.append(f"{cat}: the ConfigMap {source['configMapRef']['name']} is defined nowhere")
                    if "secretRef" in source and source["secretRef"]["name"] not in secrets:
                        problems.append(f"{cat}: the Secret {source['secretRef']['name']} is created nowhere")
                for ref in (
                    e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})
                ):
                    if ref["name"] not in secrets and (ref["name"], ref["key"]) != (token, "auth_token"):
                        problems.append(f"{cat}: the Secret {ref['name']} (key {ref['key']}) is created nowhere")
    return problems


def driver_problems(where: str, cluster: dict) -> list[str]:
    """The head's containers after the first (KubeRay starts Ray in the first, and sets RAY_AUTH_* there only) run
    the flow, Ray's driver: they need the address, the token, and the head's processes and /tmp/ray."""
    spec, name = cluster["spec"], cluster["metadata"]["name"]
    head = spec["headGroupSpec"]
    pod = head["template"]["spec"]
    port = head.get("rayStartParams", {}).get("port", "6379")
    ray_container, drivers = pod["containers"][0], pod["containers"][1:]
    problems = []
    if drivers and pod.get("shareProcessNamespace") is not True:
        problems.append(f"{where}: the head pod does not share its process namespace (ray.init finds the raylet there)")
    tmp = {m["name"] for m in ray_container.get("volumeMounts", []) if m["mountPath"] == "/tmp/ray"}
    for c in drivers:
        at = f"{where}: the head's container {c['name']}"
        if env_value(c, "RAY_ADDRESS") != f"{name}-head-svc:{port}":
            problems.append(f"{at} lacks RAY_ADDRESS={name}-head-svc:{port}")
        if spec.get("authOptions", {}).get("mode") == "token":
            if env_value(c, "RAY_AUTH_MODE") != "token":
                problems.append(f"{at} lacks RAY_AUTH_MODE=token")
            if env_value(c, "RAY_AUTH_TOKEN") != {"secretKeyRef": {"name": name, "key": "auth_token"}}:
                problems.append(f"{at} lacks RAY_AUTH_TOKEN from the Secret {name}, key auth_token")
        if not tmp or not tmp & {m["name"] for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp/ray"}:
            problems.append(f"{at} does not share /tmp/ray with {ray_container['name']} (the raylet's sockets)")
    return problems


def prefect_deployments() -> list[dict]:
    """The Prefect deployments the docs add (a YAML block that is a list of items with an entrypoint)."""
    found = []
    for _, _, text in yaml_blocks():
        for doc in documents(text):
            found += [d for d in doc if isinstance(d, dict) and "entrypoint" in d] if isinstance(doc, list) else []
    return found


def pool_problems(where: str, cluster: dict, deployments: list[dict], shell_text: str) -> list[str]:
    """A Prefect worker in the head pod serves a pool that the docs create and that a deployment of theirs names;
    that deployment's entrypoint is a flow of this repository."""
    problems = []
    for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1:]:
        command = [*c.get("command", []), *c.get("args", [])]
        if "worker" not in command or "--pool" not in command:
            continue
        pool = command[command.index("--pool") + 1]
        if not re.search(rf"prefect work-pool create {re.escape(pool)}\b", shell_text):
            problems.append(f"{where}: {c['name']} serves the pool {pool}, which the docs create nowhere")
        served = [d for d in deployments if d.get("work_pool", {}).get("name") == pool]
        if not served:
            problems.append(f"{where}: no deployment in the docs runs on the pool {pool}")
        for d in served:
            module, _, function = d["entrypoint"].partition(":")
            source = REPO / (module.replace(".", "/") + ".py")
            if not source.is_file() or f"def {function}(" not in source.read_text():
                problems.append(f"{where}: the deployment {d.get('name')} names {d['entrypoint']}, no flow here")
    return problems


def probe_problems(where: str, cluster: dict) -> list[str]:
    """The Ray container of every pod brings its own HTTP probes: the ones KubeRay 1.5 adds run wget, which the image
    does not have, so the pods would never be ready."""
    return [
        f"{where} ({pod_name}): {pod['containers'][0]['name']} has no HTTP {probe} (KubeRay's own runs wget)"
        for pod_name, pod in pods(cluster)
        for probe in ("readinessProbe", "livenessProbe")
        if "httpGet" not in pod["containers"][0].get(probe, {})
    ]


def shell_problems(where: str, text: str) -> list[str]:
    done = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    return [] if done.returncode == 0 else [f"{where}: bash -n: {done.stderr.strip()}"]


def helm_problems(shell_text: str) -> list[str]:
    """The operator's chart comes from KubeRay's repository, added first, at a version that has authOptions."""
    install = re.search(r"helm install \S+ kuberay/kuberay-operator --version (\d+)\.(\d+)\.(\d+)", shell_text)
    if not install:
        return ["no `helm install ... kuberay/kuberay-operator --version X.Y.Z` in the docs"]
    problems = []
    if HELM_REPO not in shell_text[: install.start()]:
        problems.append(f"`{HELM_REPO}` does not come before `helm install`")
    if tuple(map(int, install.groups())) < KUBERAY_MIN:
        problems.append(f"KubeRay {'.'.join(install.groups())} has no authOptions (1.5.1 and later)")
    return problems


# the tests ----------------------------------------------------------------------------------------------------


def all_shell_text() -> str:
    return "\n".join(text for _, _, text in shell_blocks())


def test_the_recipes_have_their_parts():
    kinds = {d["kind"] for _, d in manifests()}
    assert {"RayCluster", "PersistentVolumeClaim", "ConfigMap"} <= kinds, kinds
    assert SCRIPTS, "no SLURM script under deployments/slurm/"
    assert any(named for _, named, _ in yaml_blocks()), "docs/ray.md shows no excerpt of a manifest"
    assert "make image DEVICE=cuda" in all_shell_text()


def test_every_yaml_block_and_manifest_parses_and_every_excerpt_is_one():
    problems = [
        p
        for where, named, text in yaml_blocks()
        for p in parse_problems(where, text) + excerpt_problems(where, named, text)
    ]
    problems += [
        p for f in sorted(KUBERAY.glob("*.yaml")) for p in parse_problems(str(f.relative_to(REPO)), f.read_text())
    ]
    assert not problems, "\n".join(problems)


def test_every_manifest_holds_only_the_fields_of_its_kind():
    problems = [p for where, doc in manifests() for p in schema_problems(where, doc)]
    assert not problems, "\n".join(problems)


def test_nothing_a_manifest_names_is_undefined():
    problems = reference_problems(manifests(), all_shell_text())
    for where, cluster in ((w, d) for w, d in manifests() if d["kind"] == "RayCluster"):
        problems += driver_problems(where, cluster) + probe_problems(where, cluster)
        problems += pool_problems(where, cluster, prefect_deployments(), all_shell_text())
    assert not problems, "\n".join(problems)


def test_every_shell_block_and_script_passes_bash_n():
    problems = [p for where, _, text in shell_blocks() for p in shell_problems(where, text)]
    problems += [p for s in SCRIPTS for p in shell_problems(str(s.relative_to(REPO)), s.read_text())]
    assert not problems, "\n".join(problems)


def test_the_operator_comes_from_its_repository_at_a_version_with_auth_options():
    problems = helm_problems(all_shell_text())
    assert not problems, "\n".join(problems)


def test_the_paths_the_docs_name_under_deployments_exist():
    named = set(re.findall(r"\bdeployments/[\w./-]*\w", (REPO / "docs" / "ray.md").read_text()))
    assert not [p for p in sorted(named) if not (REPO / p).exists()], named


# the checks catch what they name: one broken recipe each ----------------------------------------------------


def the_cluster() -> dict:
    return copy.deepcopy(yaml.safe_load((KUBERAY / "raycluster.yaml").read_text()))


def broken(change) -> dict:
    cluster = the_cluster()
    change(cluster)
    return cluster


def head_container(cluster: dict, n: int) -> dict:
    return cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][n]


SCHEMA_BREAKS = {
    "a misspelt spec field": (lambda c: c["spec"].update(workerGroupSpec=[]), "workerGroupSpec"),
    "a number in rayStartParams": (
        lambda c: c["spec"]["headGroupSpec"].update(rayStartParams={"num-gpus": 0}),
        "rayStartParams",
    ),
    "an unknown auth mode": (lambda c: c["spec"]["authOptions"].update(mode="tokens"), "authOptions.mode"),
    "a misspelt container key": (lambda c: head_container(c, 0).update(envfrom=[]), "envfrom"),
    "a number as an env value": (lambda c: head_container(c, 1)["env"][0].update(value=6379), "env"),
    "a group without a name": (lambda c: c["spec"]["workerGroupSpecs"][0].pop("groupName"), "groupName"),
}


@pytest.mark.parametrize("case", sorted(SCHEMA_BREAKS))
def test_the_schema_check_catches_a_broken_cluster(case):
    change, expected = SCHEMA_BREAKS[case]
    problems = schema_problems("example", broken(change))
    assert problems and any(expected in p for p in problems), problems


def no_share(c):
    c["spec"]["headGroupSpec"]["template"]["spec"]["shareProcessNamespace"] = False


REFERENCE_BREAKS = {
    "an undefined claim": (
        lambda c: c["spec"]["headGroupSpec"]["template"]["spec"]["volumes"][0].update(
            persistentVolumeClaim={"claimName": "nowhere"}
        ),
        "the claim nowhere is defined nowhere",
    ),
    "an unmade Secret": (
        lambda c: head_container(c, 0)["envFrom"].append({"secretRef": {"name": "nowhere"}}),
        "Secret nowhere",
    ),
    "an undefined ConfigMap": (
        lambda c: head_container(c, 0)["envFrom"].append({"configMapRef": {"name": "nowhere"}}),
        "ConfigMap nowhere",
    ),
    "a mount of no volume": (
        lambda c: head_container(c, 0)["volumeMounts"].append({"name": "x", "mountPath": "/x"}),
        "mounts x",
    ),
    "the latest image": (
        lambda c: head_container(c, 0).update(image="registry.example.com/rlhf-pipeline:latest"),
        ":latest",
    ),
    "another Ray": (lambda c: c["spec"].update(rayVersion="2.9.0"), "rayVersion 2.9.0"),
}
DRIVER_BREAKS = {
    "another pool": (
        lambda c: head_container(c, 1).update(command=["prefect", "worker", "start", "--pool", "elsewhere"]),
        "pool elsewhere",
    ),
    "no address": (lambda c: head_container(c, 1)["env"].pop(0), "RAY_ADDRESS"),
    "no token": (lambda c: head_container(c, 1)["env"].pop(2), "RAY_AUTH_TOKEN"),
    "no shared processes": (no_share, "process namespace"),
    "no shared /tmp/ray": (lambda c: head_container(c, 1)["volumeMounts"].pop(1), "/tmp/ray"),
    "KubeRay's wget probes": (lambda c: head_container(c, 0).pop("readinessProbe"), "no HTTP readinessProbe"),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_BREAKS) + sorted(DRIVER_BREAKS))
def test_the_reference_checks_catch_a_broken_cluster(case):
    change, expected = {**REFERENCE_BREAKS, **DRIVER_BREAKS}[case]
    cluster = broken(change)
    others = [(w, d) for w, d in manifests() if d["kind"] != "RayCluster"]
    problems = reference_problems([*others, ("example", cluster)], all_shell_text()) + driver_problems(
        "example", cluster
    )
    problems += pool_problems("example", cluster, prefect_deployments(), all_shell_text())
    problems += probe_problems("example", cluster)
    assert problems and any(expected in p for p in problems), problems


def test_the_block_checks_catch_broken_blocks():
    assert parse_problems("example", "a: [1, 2\nb: 3\n")
    assert shell_problems("example", 'for node in "${nodes[@]}"; do\n  srun -w "$node" ray start\n')
    assert excerpt_problems("example", "deployments/kuberay/raycluster.yaml", "rayVersion: '2.9.0'\n")
    assert excerpt_problems("example", "deployments/kuberay/nowhere.yaml", "a: 1\n")
    assert not excerpt_problems("example", "deployments/kuberay/raycluster.yaml", "mode: token\n")
    assert schema_problems("example", {"kind": "Deployment"})
    assert helm_problems("helm install kuberay-operator kuberay/kuberay-operator --version 1.4.2\n")
    assert helm_problems(f"helm install kuberay-operator kuberay/kuberay-operator --version 1.5.1\n{HELM_REPO}\n")
    assert not helm_problems(f"{HELM_REPO}\nhelm install kuberay-operator kuberay/kuberay-operator --version 1.5.1\n")
