"""The Kubernetes manifests, checked without a cluster: every deploy file parses; the objects validate
against the Kubernetes and KubeRay schemas (vendored under schemas/, see its README) and broken copies
do not; the Ray version agrees with pyproject.toml everywhere; every command they run exists with the
flags given; the job files are valid Elastron configs; and the cluster has the shape docs/deploy.md
describes (spot GPU workers, a head that trains nothing, drains that fit in the grace period, shared
checkpoints). The Dockerfile and the cluster-launcher config have their own test files.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.deploy.helpers import (ALL_YAML, CUDA_OF_TORCH, DEPLOY, DOCKERFILE, K8S_FILES, KUBERAY, LAUNCHER, ROOT,
                                  cluster_specs, docs, one, pins, pod_specs, shell_commands)

SCHEMAS = Path(__file__).parent / "schemas"

# (apiVersion, kind) -> definition in the merged schema
KINDS = {
    ("ray.io/v1", "RayCluster"): "io.ray.v1.RayCluster",
    ("ray.io/v1", "RayJob"): "io.ray.v1.RayJob",
    ("v1", "Service"): "io.k8s.api.core.v1.Service",
    ("v1", "ConfigMap"): "io.k8s.api.core.v1.ConfigMap",
    ("v1", "PersistentVolumeClaim"): "io.k8s.api.core.v1.PersistentVolumeClaim",
    ("v1", "Secret"): "io.k8s.api.core.v1.Secret",
    ("networking.k8s.io/v1", "NetworkPolicy"): "io.k8s.api.networking.v1.NetworkPolicy",
}



# -- helpers ------------------------------------------------------------------------------------------
@cache
def validator() -> jsonschema.protocols.Validator:
    core = json.loads((SCHEMAS / "k8s-core.json").read_text())
    ray = json.loads((SCHEMAS / "kuberay-v1.json").read_text())
    schema = {"$schema": core["$schema"], "$defs": {**core["$defs"], **ray["$defs"]}}
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def schema_errors(doc: dict) -> list[str]:
    name = KINDS.get((doc.get("apiVersion"), doc.get("kind")))
    if name is None:
        return [f"no schema for apiVersion={doc.get('apiVersion')!r} kind={doc.get('kind')!r} (add one to KINDS)"]
    v = validator()
    sub = v.evolve(schema={"$schema": v.schema["$schema"], "$defs": v.schema["$defs"], "$ref": f"#/$defs/{name}"})
    out = []
    for e in sub.iter_errors(doc):
        why = "; ".join(sorted({c.message for c in e.context}))  # the branches of an anyOf/oneOf
        out.append(f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" + (f" ({why})" if why else ""))
    return out


def elastron_commands() -> list[list[str]]:
    """Every `elastron ...` command line the manifests and the launcher config run."""
    texts = [one("RayJob")["spec"]["entrypoint"]]
    for _, pod in pod_specs():
        for c in pod["containers"]:
            texts.append(" ".join(c.get("command", []) + c.get("args", [])))
    launcher = yaml.safe_load(LAUNCHER.read_text())
    texts += launcher.get("head_start_ray_commands", []) + launcher.get("worker_start_ray_commands", [])
    return [argv[1:] for text in texts for argv in shell_commands(text) if Path(argv[0]).name == "elastron"]


# -- parsing and versions -----------------------------------------------------------------------------
@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_manifest_parses(path):
    found = list(yaml.safe_load_all(path.read_text()))
    assert found and all(isinstance(d, dict) for d in found if d is not None), path


def test_ray_version_is_the_same_everywhere():
    ray = pins()["ray"]
    for where, spec in cluster_specs().items():
        assert spec["rayVersion"] == ray, where
    images = [c["image"] for _, pod in pod_specs() for c in pod["containers"]]
    kustomize = yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())["images"]
    images += [f"{i['newName']}:{i['newTag']}" for i in kustomize]
    for image in images:
        assert re.search(rf"-ray{re.escape(ray)}-", image.rsplit(":", 1)[1]), f"{image} does not name ray {ray}"
    cuda_tag = "cu" + CUDA_OF_TORCH[pins()["torch"]].replace(".", "")
    assert all(image.endswith(cuda_tag) for image in images), f"GPU images should be tagged {cuda_tag}: {images}"
    texts = [LAUNCHER.read_text(), (ROOT / "docs" / "deploy.md").read_text(), DOCKERFILE.read_text()]
    for text in texts:
        for v in re.findall(r"ray(?:\[[a-z,]+\])?==([0-9][\w.]*)", text):
            assert v == ray, f"a ray=={v} where pyproject pins {ray}"


# -- commands -----------------------------------------------------------------------------------------
def test_entrypoints_exist_with_the_flags_used(capsys):
    from api.cli import build_parser, main

    cmds = elastron_commands()
    subs = {c[0] for c in cmds}
    assert {"run", "serve"} <= subs, cmds
    for sub in sorted(subs):
        with pytest.raises(SystemExit) as e:
            main([sub, "--help"])
        assert e.value.code == 0, sub
    capsys.readouterr()
    for argv in cmds:  # the exact flags given parse (argparse exits 2 on an unknown one)
        build_parser().parse_args(argv)


def test_ray_commands_exist_with_the_flags_used():
    from ray.scripts.scripts import cli

    launcher = yaml.safe_load(LAUNCHER.read_text())
    lines = launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]
    api = next(c for _, pod in pod_specs() for c in pod["containers"] if c["name"] == "elastron-api")
    lines.append(" ".join(api["command"]))
    seen = set()
    for line in lines:
        for part in re.split(r";|&&|\n|\bdo\b|\bdone\b|\buntil\b", line):
            words = shlex.split(part.replace("$RAY_HEAD_IP", "10.0.0.1"))
            words = [w for w in words if not w.startswith((">", "2>"))]
            if len(words) >= 2 and words[0] == "ray":
                cli.commands[words[1]].make_context(words[1], words[2:])  # raises on an unknown flag
                seen.add(words[1])
    assert {"start", "stop", "health-check"} <= seen
    start_flags = {p.name.replace("_", "-") for p in cli.commands["start"].params}
    for where, spec in cluster_specs().items():
        groups = [spec["headGroupSpec"]] + spec.get("workerGroupSpecs", [])
        for g in groups:
            unknown = set(g.get("rayStartParams", {})) - start_flags
            assert not unknown, f"{where}: rayStartParams that `ray start` lacks: {unknown}"


def test_job_files_are_valid_elastron_configs():
    from workers.config import JobConfig, load_config

    cm = one("ConfigMap")
    cfg = JobConfig.from_dict(yaml.safe_load(cm["data"]["job.yaml"]))
    assert cfg.resources.device == "cuda" and cfg.resources.gpus_per_worker == 1
    launcher_job = load_config(LAUNCHER.parent / "job.yaml")
    assert str(launcher_job.checkpoint.dir).startswith("s3://"), "launcher nodes share no disk: checkpoints to S3"
    # the RayJob runs the ConfigMap's job.yaml from where the head mounts it
    words = shlex.split(one("RayJob")["spec"]["entrypoint"])
    assert words[:2] == ["elastron", "run"]
    config_path = Path(words[2])
    head = one("RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    vols = {v["name"]: v for v in head["volumes"]}
    mount = next(m for m in head["containers"][0]["volumeMounts"] if Path(m["mountPath"]) == config_path.parent)
    assert vols[mount["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    assert config_path.name in cm["data"]


# -- schemas ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", K8S_FILES, ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_and_kuberay_schemas(path):
    for doc in docs(path):
        errors = schema_errors(doc)
        assert not errors, f"{path.name} {doc.get('kind')}:\n  " + "\n  ".join(errors)


BREAKAGES = [
    ("RayCluster", lambda d: d["spec"]["workerGroupSpecs"][1].update(minReplica=1), "minReplica"),
    ("RayCluster", lambda d: d["spec"]["workerGroupSpecs"][1].update(replicas="two"), "replicas"),
    ("RayCluster", lambda d: d["spec"]["autoscalerOptions"].update(version="v3"), "version"),
    ("RayCluster", lambda d: d["spec"].pop("headGroupSpec"), "headGroupSpec"),
    ("RayCluster", lambda d: d["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].update(resource={}),
     "resource"),  # a typo inside the pod template: the core schema is strict too
    ("RayCluster", lambda d: d["spec"]["workerGroupSpecs"][1]["template"]["spec"]["tolerations"][0].update(
        effect=7), "effect"),
    ("RayJob", lambda d: d["spec"].pop("rayClusterSpec"), "rayClusterSpec"),
    ("RayJob", lambda d: d["spec"].update(submissionMode="Batch"), "submissionMode"),
    ("Service", lambda d: d["spec"]["ports"][0].update(prot=8000), "prot"),
    ("PersistentVolumeClaim", lambda d: d["spec"].update(accessModes="ReadWriteMany"), "accessModes"),
    ("ConfigMap", lambda d: d.update(date={}), "date"),
    ("NetworkPolicy", lambda d: d["spec"].update(ingres=[]), "ingres"),
    ("NetworkPolicy", lambda d: d["spec"].update(policyTypes="Ingress"), "policyTypes"),
    ("NetworkPolicy", lambda d: d["spec"]["ingress"][0]["from"][0].update(podSelctor={}), "podSelctor"),
]


@pytest.mark.parametrize("kind, breakage, word", BREAKAGES, ids=[f"{k}-{w}" for k, _, w in BREAKAGES])
def test_the_schemas_reject_broken_manifests(kind, breakage, word):
    doc = copy.deepcopy(next(d for p in K8S_FILES for d in docs(p) if d.get("kind") == kind))
    assert not schema_errors(doc)
    breakage(doc)
    errors = schema_errors(doc)
    assert errors and any(word in e for e in errors), errors


def test_secret_template_validates_and_is_not_applied_by_kustomize():
    example = KUBERAY / "secrets.example.yaml"
    secrets = docs(example)
    assert {s["metadata"]["name"] for s in secrets} >= {"elastron-api"}
    for s in secrets:
        assert not schema_errors(s)
    assert example.name not in yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())["resources"]
    api = next(c for _, pod in pod_specs() for c in pod["containers"] if c["name"] == "elastron-api")
    token = next(e for e in api["env"] if e["name"] == "ELASTRON_API_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "elastron-api"
    assert token["valueFrom"]["secretKeyRef"]["key"] in secrets[0]["stringData"]


# -- the cluster's shape ------------------------------------------------------------------------------
def test_head_trains_nothing_and_autoscaler_v2_is_on():
    for where, spec in cluster_specs().items():
        assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0", where
        assert spec["enableInTreeAutoscaling"] is True, where
        assert spec["autoscalerOptions"]["version"] == "v2", where


def test_api_sidecar_beside_the_head_and_its_service():
    head = one("RayCluster")["spec"]["headGroupSpec"]["template"]
    ray, api = head["spec"]["containers"][:2]
    assert ray["name"] == "ray-head", "KubeRay takes the first container as the Ray container"
    assert "elastron serve --address auto --host 0.0.0.0" in " ".join(api["command"])
    env = {e["name"]: e for e in api["env"]}
    assert env["ELASTRON_RUNS_ROOT"]["value"] == "/checkpoints"
    store_dir = str(Path(env["ELASTRON_STORE"]["value"]).parent)
    mount = next(m for m in api["volumeMounts"] if m["mountPath"] == store_dir)
    vols = {v["name"]: v for v in head["spec"]["volumes"]}
    claim = vols[mount["name"]]["persistentVolumeClaim"]["claimName"]
    store = next(d for d in docs(KUBERAY / "storage.yaml") if d["metadata"]["name"] == claim)
    assert store["spec"]["accessModes"] == ["ReadWriteOnce"], "SQLite WAL must not live on a shared (NFS) claim"
    # the sidecar is a Ray driver: it needs the head's /tmp/ray (raylet sockets)
    tmp = {c["name"]: {m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp/ray"} for c in (ray, api)}
    assert tmp["ray-head"] and tmp["ray-head"] == tmp["elastron-api"]
    svc = one("Service")
    ports = {p["name"]: p for p in svc["spec"]["ports"]}
    assert set(ports) == {"api"} and ports["api"]["port"] == 8000  # not Ray's 8265 (job API) or 6379 (GCS)
    container_ports = {p["name"]: p["containerPort"] for c in (ray, api) for p in c["ports"]}
    for p in ports.values():
        assert container_ports[p["targetPort"]] == p["port"], p
    assert svc["spec"]["selector"] == {"ray.io/cluster": one("RayCluster")["metadata"]["name"],
                                       "ray.io/node-type": "head"}


def test_worker_groups_cpu_on_demand_and_gpu_on_spot():
    groups = {g["groupName"]: g for g in one("RayCluster")["spec"]["workerGroupSpecs"]}
    cpu, gpu = groups["cpu"], groups["gpu-spot"]
    for g in (cpu, gpu):
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], g["groupName"]
    gpu_pod, cpu_pod = gpu["template"]["spec"], cpu["template"]["spec"]
    assert gpu_pod["nodeSelector"].get("cloud.google.com/gke-spot") == "true"
    assert "cloud.google.com/gke-spot" not in cpu_pod["nodeSelector"]
    assert any(t["key"] == "cloud.google.com/gke-spot" and t["effect"] == "NoSchedule"
               for t in gpu_pod["tolerations"])
    limits = lambda pod: pod["containers"][0]["resources"]["limits"]  # noqa: E731
    assert limits(gpu_pod)["nvidia.com/gpu"] == "1" and "nvidia.com/gpu" not in limits(cpu_pod)
    head = one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    assert head["nodeSelector"] == cpu_pod["nodeSelector"], "the head belongs on the on-demand pool"


def test_every_container_requests_what_it_limits():
    for where, pod in pod_specs():
        for c in pod["containers"]:
            r = c["resources"]
            assert r["requests"] == r["limits"], f"{where}/{c['name']}"
    for spec in cluster_specs().values():
        r = spec["autoscalerOptions"]["resources"]
        assert r["requests"] == r["limits"]


def test_drain_timeout_fits_in_the_grace_period():
    """SIGTERM makes `ray start --block` drain its node for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S; the pod
    must not be killed before that (the default grace period is 30 s, the drain default 30 s)."""
    for where, pod in pod_specs():
        if where.endswith("/head"):
            continue
        env = {e["name"]: e.get("value") for e in pod["containers"][0].get("env", [])}
        drain = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
        assert 0 < drain < pod["terminationGracePeriodSeconds"], where
        assert pod.get("restartPolicy") == "Never", where


def test_ray_token_auth_is_on_and_the_api_joins_with_the_token():
    """Ray's job API runs arbitrary code: every Ray cluster of the deploy needs Ray's token."""
    secrets = {s["metadata"]["name"]: s for s in docs(KUBERAY / "secrets.example.yaml")}
    for where, spec in cluster_specs().items():
        auth = spec.get("authOptions") or {}
        assert auth.get("mode") == "token", where
        assert "auth_token" in secrets[auth["secretName"]]["stringData"], where
    api = next(c for _, pod in pod_specs() for c in pod["containers"] if c["name"] == "elastron-api")
    env = {e["name"]: e for e in api["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token"
    assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": cluster_specs()["raycluster"]["authOptions"]["secretName"], "key": "auth_token"}


def test_checkpoints_are_shared_by_every_ray_pod():
    pvc = next(d for d in docs(KUBERAY / "storage.yaml") if d["metadata"]["name"] == "elastron-checkpoints")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for where, pod in pod_specs():
        claims = {v["name"] for v in pod["volumes"]
                  if v.get("persistentVolumeClaim", {}).get("claimName") == pvc["metadata"]["name"]}
        mounts = {m["name"] for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/checkpoints"}
        assert claims & mounts, f"{where} does not mount the checkpoint claim at /checkpoints"
    words = shlex.split(one("RayJob")["spec"]["entrypoint"])
    assert words[words.index("--run-dir") + 1].startswith("/checkpoints/")
    assert one("RayJob")["spec"]["backoffLimit"] >= 1, "a lost head is survived by resubmission"


def test_rayjob_cluster_matches_the_raycluster():
    ours, jobs = cluster_specs()["raycluster"], cluster_specs()["rayjob"]
    for key in ("rayVersion", "enableInTreeAutoscaling", "autoscalerOptions"):
        assert jobs[key] == ours[key], key
    assert jobs["headGroupSpec"]["rayStartParams"] == ours["headGroupSpec"]["rayStartParams"]
    head_ours = ours["headGroupSpec"]["template"]["spec"]
    head_job = jobs["headGroupSpec"]["template"]["spec"]
    assert head_job["containers"][0]["image"] == head_ours["containers"][0]["image"]
    assert head_job["nodeSelector"] == head_ours["nodeSelector"]
    gpu_ours = next(g for g in ours["workerGroupSpecs"] if g["groupName"] == "gpu-spot")
    gpu_job = copy.deepcopy(next(g for g in jobs["workerGroupSpecs"] if g["groupName"] == "gpu-spot"))
    # the one difference: the job's pods carry the label its NetworkPolicies select (test_network_policy.py)
    gpu_job["template"]["metadata"]["labels"].pop("app.kubernetes.io/instance")
    assert gpu_job == gpu_ours


def test_kustomize_renders_and_overrides_the_image(tmp_path):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed")
    for p in KUBERAY.glob("*.yaml"):
        shutil.copy(p, tmp_path / p.name)
    k = tmp_path / "kustomization.yaml"
    k.write_text(k.read_text().replace("newTag: ", "newTag: probe-").replace("newName: registry.example.com",
                                                                            "newName: probe.example.org"))
    out = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {d["kind"] for d in rendered} == {"RayCluster", "Service", "ConfigMap", "PersistentVolumeClaim",
                                             "NetworkPolicy"}
    assert all(d["metadata"]["namespace"] == "elastron" for d in rendered)
    images = re.findall(r"image: (\S+)", out.stdout)
    assert images and all(i.startswith("probe.example.org/elastron:probe-") for i in images), images


def test_docs_name_only_files_that_exist():
    text = (ROOT / "docs" / "deploy.md").read_text()
    paths = set(re.findall(r"`((?:deploy|tools|tests/deploy)/[\w./-]+)`", text))
    assert paths, "docs/deploy.md names no deploy files"
    for p in sorted(paths):
        assert (ROOT / p).exists(), f"docs/deploy.md names {p}, which does not exist"


def test_every_spot_worker_runs_the_spot_watcher_beside_ray():
    """The sidecar that turns the cloud's own notice into a drain: its command parses, it names a cloud
    the watcher knows, it shares /tmp/ray with the Ray container (the GCS address file `ray start`
    writes) and it joins the token-auth cluster with the token."""
    from tools.spot_watcher import CLOUDS, build_parser

    spot = [(w, pod) for w, pod in pod_specs() if w.endswith("/gpu-spot")]
    assert {w for w, _ in spot} == {"raycluster/gpu-spot", "rayjob/gpu-spot"}
    for where, pod in spot:
        ray, watcher = pod["containers"][0], next(c for c in pod["containers"] if c["name"] == "spot-watcher")
        [argv] = [a for a in shell_commands(" ".join(watcher["command"])) if a[-1:] != ["done"]
                  and any(w.endswith("spot_watcher.py") for w in a)]
        args = build_parser().parse_args(argv[argv.index(next(w for w in argv if w.endswith("spot_watcher.py"))) + 1:])
        assert args.interval_s > 0, where
        env = {e["name"]: e for e in watcher["env"]}
        assert env["SPOT_WATCHER_CLOUD"]["value"] in CLOUDS, where
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "elastron-ray-auth", where
        tmp = lambda c: {m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp/ray"}  # noqa: E731
        assert tmp(ray) and tmp(ray) == tmp(watcher), where
        assert "/tmp/ray/ray_current_cluster" in " ".join(watcher["command"]), where
