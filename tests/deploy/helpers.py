"""Shared pieces of the deploy tests: paths, the pins in pyproject.toml, and the manifests' documents."""

from __future__ import annotations

import re
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
