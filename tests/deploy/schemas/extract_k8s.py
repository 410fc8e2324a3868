"""Regenerate k8s-core.json: the Kubernetes core/v1 and networking/v1 object schemas the deploy manifests use.

Source: the strict JSON schemas shipped in the `kubernetes-validate` wheel on PyPI (generated from the
Kubernetes OpenAPI spec by the kubernetes-json-schema project; Apache-2.0). Only the definitions
reachable from ROOTS are kept, descriptions are dropped, and `$ref`s are made local ("#/$defs/...").

    pip download --no-deps -d /tmp/kv kubernetes-validate==1.37.0
    unzip -q /tmp/kv/kubernetes_validate-1.37.0-py3-none-any.whl -d /tmp/kv/x
    python tests/deploy/schemas/extract_k8s.py \
        /tmp/kv/x/kubernetes_validate/kubernetes-json-schema/v1.34.0-local-strict > tests/deploy/schemas/k8s-core.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOTS = [
    "io.k8s.api.core.v1.ConfigMap",
    "io.k8s.api.core.v1.PersistentVolumeClaim",
    "io.k8s.api.core.v1.PodTemplateSpec",
    "io.k8s.api.core.v1.Secret",
    "io.k8s.api.core.v1.Service",
    "io.k8s.api.networking.v1.NetworkPolicy",
    # KubeRay's own fields embed these (autoscalerOptions, headService, Redis credentials):
    "io.k8s.api.core.v1.EnvFromSource",
    "io.k8s.api.core.v1.EnvVar",
    "io.k8s.api.core.v1.EnvVarSource",
    "io.k8s.api.core.v1.ResourceRequirements",
    "io.k8s.api.core.v1.SecurityContext",
    "io.k8s.api.core.v1.VolumeMount",
]
_PREFIX = "/api/_definitions.json#/$defs/"
_DROP = {"description"}


def _clean(node):
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in _DROP or k.startswith("x-kubernetes-group-version-kind"):
                continue
            if k == "$ref" and isinstance(v, str) and v.startswith(_PREFIX):
                v = "#/$defs/" + v[len(_PREFIX):]
            out[k] = _clean(v)
        return out
    if isinstance(node, list):
        return [_clean(v) for v in node]
    return node


def _refs(node, acc: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            acc.add(ref[len("#/$defs/"):])
        for v in node.values():
            _refs(v, acc)
    elif isinstance(node, list):
        for v in node:
            _refs(v, acc)


def extract(schema_dir: Path) -> dict:
    defs = json.loads((schema_dir / "_definitions.json").read_text())["$defs"]
    keep: dict[str, dict] = {}
    todo = list(ROOTS)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = _clean(defs[name])
        found: set[str] = set()
        _refs(keep[name], found)
        todo.extend(sorted(found - keep.keys()))
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$comment": f"Kubernetes {schema_dir.name.split('-')[0]} core/v1 and networking/v1 schemas (strict), subset; "
                        "see extract_k8s.py",
            "$defs": dict(sorted(keep.items()))}


if __name__ == "__main__":
    json.dump(extract(Path(sys.argv[1])), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
