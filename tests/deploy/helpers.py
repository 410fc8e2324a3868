"""Shared pieces of the deploy tests: paths, the pins in pyproject.toml, and the manifests' documents."""

from __future__ import annotations

import re
import shlex
import tomllib
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUBERAY = DEPLOY / "kuberay"
LAUNCHER = DEPLOY / "cluster-launcher" / "aws-spot.yaml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
ALL_YAML = sorted(DEPLOY.rglob("*.yaml"))
K8S_FILES = sorted(p for p in KUBERAY.glob("*.yaml") if p.name != "kustomization.yaml")

# The CUDA version torch's default Linux x86_64 wheel on PyPI is built for (its requirement
# cuda-toolkit==13.0.3 for 2.13.0). A torch bump must revisit the Dockerfile's CUDA base.
CUDA_OF_TORCH = {"2.13.0": "13.0"}


@cache
def pins() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for dep in deps:
        m = re.fullmatch(r"(ray|torch)(?:\[[^\]]*\])?==([\w.]+)", dep.replace(" ", ""))
        if m:
            out[m[1]] = m[2]
    assert set(out) == {"ray", "torch"}, f"pyproject.toml must pin ray and torch exactly, got {deps}"
    return out


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def one(kind: str, path: Path | None = None) -> dict:
    found = [d for p in ([path] if path else K8S_FILES) for d in docs(p) if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def cluster_specs() -> dict[str, dict]:
    """The RayCluster spec of raycluster.yaml and the inline one of rayjob.yaml."""
    return {"raycluster": one("RayCluster")["spec"], "rayjob": one("RayJob")["spec"]["rayClusterSpec"]}


def pod_specs() -> list[tuple[str, dict]]:
    out = []
    for where, spec in cluster_specs().items():
        out.append((f"{where}/head", spec["headGroupSpec"]["template"]["spec"]))
        out += [(f"{where}/{g['groupName']}", g["template"]["spec"]) for g in spec.get("workerGroupSpecs", [])]
    return out


_WRAPPERS = {"exec", "nohup", "setsid"}


def shell_commands(text: str) -> list[list[str]]:
    """The programs a shell line runs, each as [program, *args]: split at `;`, `&&`, `||` and newlines;
    `VAR=value`, exec/nohup/setsid and start-stop-daemon's own options dropped (its --startas program
    kept); cut at the first redirection or `&`. `export VAR=...` alone yields nothing."""
    out = []
    for part in re.split(r";|&&|\|\||\n", text):
        words = shlex.split(part)
        if words[:1] == ["export"]:
            continue
        words = words[:next((i for i, w in enumerate(words) if w.startswith((">", "<", "2>", "&"))), len(words))]
        while words and (words[0] in _WRAPPERS or re.fullmatch(r"[A-Za-z_]\w*=.*", words[0])):
            words = words[1:]
        if words[:1] == ["start-stop-daemon"] and "--startas" in words:
            i = words.index("--startas")
            rest = words[i + 2:]
            words = [words[i + 1], *(rest[1:] if rest[:1] == ["--"] else rest)]
        if words:
            out.append(words)
    return out
