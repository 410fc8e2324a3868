"""deploy/docker/Dockerfile and .dockerignore, read as text (no Docker daemon needed): the pins, the CUDA
base torch's wheel needs, torch installed before the project, a CPU variant, a numeric non-root user,
and a build context that holds every package the image copies.
"""

from __future__ import annotations

import json
import re
import tomllib

from tests.deploy.helpers import CUDA_OF_TORCH, DOCKERFILE, ROOT, pins


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            instr, _, rest = buf.partition(" ")
            out.append((instr.upper(), rest.strip()))
            buf = ""
    return out


def docker_args() -> dict[str, str]:
    return {k: v.strip('"') for instr, rest in dockerfile() if instr == "ARG" and "=" in rest
            for k, _, v in [rest.partition("=")]}


def test_dockerfile_installs_the_pinned_torch_first_then_the_project():
    args = docker_args()
    assert args["RAY_VERSION"] == pins()["ray"]
    assert args["TORCH_VERSION"] == pins()["torch"]
    runs = [rest for instr, rest in dockerfile() if instr == "RUN"]
    torch_i = next(i for i, r in enumerate(runs) if re.search(r'pip install .*"torch==\$\{TORCH_VERSION\}"', r))
    project_i = next(i for i, r in enumerate(runs) if re.search(r"pip install \. ", r))
    assert torch_i < project_i, "torch==<pin> must be installed before `pip install .`"
    assert "ray.__version__ == '${RAY_VERSION}'" in runs[project_i], "the build must check the installed Ray"


def test_dockerfile_cuda_base_matches_torchs_wheel_and_has_a_cpu_variant():
    args = docker_args()
    cuda = re.search(r"nvidia/cuda:(\d+\.\d+)\.\d+-(base|runtime)-", args["CUDA_IMAGE"])
    assert cuda, args["CUDA_IMAGE"]
    assert cuda[1] == CUDA_OF_TORCH[pins()["torch"]], (
        f"torch {pins()['torch']}'s default wheel targets CUDA {CUDA_OF_TORCH[pins()['torch']]}, "
        f"the base image has {cuda[1]}")
    stages = {rest.split()[-1] for instr, rest in dockerfile() if instr == "FROM" and " AS " in rest.upper()}
    assert {"base-cuda", "base-cpu"} <= stages
    final = [rest for instr, rest in dockerfile() if instr == "FROM"][-1]
    assert final == "base-${BASE}" and args["BASE"] == "cuda"


def test_dockerfile_runs_as_a_numeric_non_root_user():
    users = [rest for instr, rest in dockerfile() if instr == "USER"]
    assert users, "no USER instruction: the image would run as root"
    uid = docker_args()["UID"] if users[-1] == "${UID}" else users[-1]
    assert uid.isdigit() and int(uid) != 0, "USER must be a numeric uid other than 0 (runAsNonRoot checks it)"
    cmd = [rest for instr, rest in dockerfile() if instr == "CMD"][-1]
    assert json.loads(cmd)[0] == "elastron"


def test_dockerfile_copies_every_package_and_dockerignore_keeps_them():
    copied = {src for instr, rest in dockerfile() if instr == "COPY" for src in rest.split()[:-1]}
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    missing = {p.rstrip("*") for p in packages} - copied
    assert not missing, f"packages not copied into the image: {missing}"
    for src in copied:
        assert (ROOT / src).exists(), src
    ignored = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")]
    assert {".venv", "runs", ".git", "**/__pycache__", ".pytest_cache"} <= set(ignored)
    assert not set(ignored) & copied, "the Dockerfile copies something .dockerignore leaves out"
