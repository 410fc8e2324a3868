"""The NetworkPolicies of deploy/kuberay/, evaluated the way Kubernetes applies them, on the pods KubeRay
would create from the manifests: every Ray pod is selected; from outside its Ray cluster only the
Elastron API's port is open (and, on a RayJob's head, the job API to its submitter pod and to the KubeRay
operator); inside the cluster every port is. Deliberately broken copies fail the same checks.

The evaluator is a small model of NetworkPolicy ingress semantics (networking.k8s.io/v1): policies are
additive; a pod that no policy with policyType Ingress selects takes everything; a rule without `from`
admits every source and one without `ports` every port; a peer with both selectors needs both to match;
a peer with only a podSelector means the policy's own namespace. Protocols are not told apart (an
over-estimate of what is open). Pod labels are KubeRay's (`labelPod` in
ray-operator/controllers/ray/common/pod.go): the template's labels plus ray.io/cluster, ray.io/node-type,
ray.io/group, ray.io/is-ray-node, ray.io/identifier and app.kubernetes.io/created-by, the first three not
overridable.
"""

from __future__ import annotations

import copy
import ipaddress
from dataclasses import dataclass, field

import pytest

from tests.deploy.helpers import KUBERAY, docs, one

NAMESPACE = "elastron"  # kustomization.yaml's, and where docs/deploy.md applies rayjob.yaml
OPERATOR_NAMESPACE = "kuberay-system"  # docs/deploy.md installs the operator's Helm chart there
EVERY_PORT = frozenset(range(1, 65536))
# Ports a Ray node listens on: GCS, dashboard/job API, client, object manager (as the launcher pins it),
# dashboard agent, metrics, the first and last default worker ports, and a random one (node manager etc.).
RAY_PORTS = (6379, 8265, 10001, 8076, 52365, 8080, 10002, 19999, 41234)
DASHBOARD_PORT = 8265  # `ray start`'s default; the manifests' rayStartParams set no dashboard-port


@dataclass(frozen=True, eq=False)  # hashed by identity: sources are dict keys
class Pod:
    name: str
    namespace: str | None  # None: not a pod (a client on the internet)
    labels: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # named container ports
    ip: str = "10.8.0.10"


def kuberay_pods(spec: dict, cluster: str) -> list[Pod]:
    """The pods KubeRay creates for a RayCluster spec named `cluster`, one per group."""
    def pod(group_spec: dict, node_type: str, group: str) -> Pod:
        template = group_spec["template"]
        labels = {"ray.io/is-ray-node": "yes", "ray.io/identifier": f"{cluster}-{node_type}",
                  "app.kubernetes.io/name": "kuberay", "app.kubernetes.io/created-by": "kuberay-operator"}
        labels.update({**template.get("metadata", {}).get("labels", {}), **group_spec.get("labels", {})})
        labels.update({"ray.io/cluster": cluster, "ray.io/node-type": node_type, "ray.io/group": group})
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
                 if "name" in p}
        return Pod(f"{cluster}/{group}", NAMESPACE, labels, ports)

    return [pod(spec["headGroupSpec"], "head", "headgroup")] + [
        pod(g, "worker", g["groupName"]) for g in spec.get("workerGroupSpecs", [])]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector; {} selects everything."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def admits(peer: dict, src: Pod, policy_ns: str) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(src.ip)
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(c) for c in block.get("except") or [])
    if src.namespace is None:
        return False  # pod and namespace selectors only ever match pods
    if "namespaceSelector" in peer:
        ns_ok = selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": src.namespace})
    else:
        ns_ok = src.namespace == policy_ns
    return ns_ok and ("podSelector" not in peer or selects(peer["podSelector"], src.labels))


def isolating(policies: list[dict], pod: Pod) -> list[dict]:
    """The policies that select `pod` for ingress."""
    return [p for p in policies
            if p["metadata"].get("namespace", NAMESPACE) == pod.namespace
            and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
            and selects(p["spec"].get("podSelector", {}), pod.labels)]


def open_ports(policies: list[dict], dst: Pod, src: Pod) -> frozenset[int]:
    """The ports of `dst` that `src` can connect to."""
    selecting = isolating(policies, dst)
    if not selecting:
        return EVERY_PORT
    out: set[int] = set()
    for p in selecting:
        ns = p["metadata"].get("namespace", NAMESPACE)
        for rule in p["spec"].get("ingress") or []:
            if rule.get("from") and not any(admits(peer, src, ns) for peer in rule["from"]):
                continue
            if not rule.get("ports"):
                return EVERY_PORT
            for port in rule["ports"]:
                number = port.get("port")
                if number is None:
                    return EVERY_PORT
                if isinstance(number, str):  # a named port: the destination's container port of that name
                    if number in dst.ports:
                        out.add(dst.ports[number])
                else:
                    out.update(range(number, port.get("endPort", number) + 1))
    return frozenset(out)


def describe(ports: frozenset[int]) -> str:
    if ports == EVERY_PORT:
        return "every port"
    shown = sorted(ports)
    return ", ".join(map(str, shown[:8])) + (f" (+{len(shown) - 8} more)" if len(shown) > 8 else "") or "nothing"


def check(policies: list[dict], cluster: list[Pod], expected_from: dict[Pod, dict[str, frozenset[int]]]) -> list[str]:
    """Problems: a pod of `cluster` no policy selects; a pod of the cluster that cannot reach another on some
    Ray port; a source of `expected_from` (outside the cluster) whose open ports on a pod (by its
    ray.io/node-type) differ from the expected ones."""
    problems = [f"{pod.name} is selected by no NetworkPolicy for ingress" for pod in cluster
                if not isolating(policies, pod)]
    for src in cluster:
        for dst in cluster:
            missing = set(RAY_PORTS) - open_ports(policies, dst, src)
            if missing:
                problems.append(f"{src.name} cannot reach {dst.name} on Ray's ports {sorted(missing)}")
    for src, by_type in expected_from.items():
        for dst in cluster:
            got, want = open_ports(policies, dst, src), by_type[dst.labels["ray.io/node-type"]]
            if got != want:
                problems.append(f"{src.name} reaches {dst.name} on {describe(got)}; expected {describe(want)}")
    return problems


# -- the two clusters, and who stands around them -----------------------------------------------------
RAYJOB_CLUSTER = "elastron-llama-125m-x7k2p"  # KubeRay names a RayJob's cluster RAYJOB-<5 random characters>
INTERNET = Pod("a client on the internet", None, ip="198.51.100.7")
INGRESS = Pod("an ingress controller", "ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"}, ip="10.8.1.2")
NEIGHBOUR = Pod("another pod of the namespace", NAMESPACE, {"app": "notebook"}, ip="10.8.1.3")
OPERATOR = Pod("the KubeRay operator", OPERATOR_NAMESPACE,
               {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/instance": "kuberay-operator"},
               ip="10.8.1.4")
OPERATOR_NEIGHBOUR = Pod("another pod beside the operator", OPERATOR_NAMESPACE,
                         {"app.kubernetes.io/name": "kuberay-apiserver"}, ip="10.8.1.5")
FAKE_OPERATOR = Pod("an operator look-alike in another namespace", "default",
                    {"app.kubernetes.io/name": "kuberay-operator"}, ip="10.8.1.6")


def submitter(rayjob: dict) -> Pod:
    """The K8sJobMode submitter: a pod of the Job KubeRay names after the RayJob, with only the labels
    Kubernetes puts on every Job's pods (KubeRay 1.7 adds ray.io/originated-from-*; 1.6 does not)."""
    name = rayjob["metadata"]["name"]
    return Pod("the RayJob's submitter pod", NAMESPACE,
               {"batch.kubernetes.io/job-name": name, "job-name": name,
                "batch.kubernetes.io/controller-uid": "0c5e", "controller-uid": "0c5e"}, ip="10.8.1.7")


def api_port() -> int:
    """The head's container port the elastron-api Service targets."""
    svc = one("Service")
    (port,) = svc["spec"]["ports"]
    head = one("RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]
    return next(p["containerPort"] for c in head["containers"] for p in c.get("ports", [])
                if p.get("name") == port["targetPort"] or p["containerPort"] == port["targetPort"])


def raycluster_problems(raycluster: dict, policies: list[dict], rayjob: dict) -> list[str]:
    ours = kuberay_pods(raycluster["spec"], raycluster["metadata"]["name"])
    others = kuberay_pods(rayjob["spec"]["rayClusterSpec"], RAYJOB_CLUSTER)
    api_only = {"head": frozenset({api_port()}), "worker": frozenset()}
    outsiders = [INTERNET, INGRESS, NEIGHBOUR, OPERATOR, submitter(rayjob), *others]
    return check(policies, ours, {src: api_only for src in outsiders})


def rayjob_problems(rayjob: dict, policies: list[dict], raycluster: dict) -> list[str]:
    ours = kuberay_pods(rayjob["spec"]["rayClusterSpec"], RAYJOB_CLUSTER)
    others = kuberay_pods(raycluster["spec"], raycluster["metadata"]["name"])
    nothing = {"head": frozenset(), "worker": frozenset()}
    job_api = {"head": frozenset({DASHBOARD_PORT}), "worker": frozenset()}
    expected = {src: nothing for src in (INTERNET, INGRESS, NEIGHBOUR, OPERATOR_NEIGHBOUR, FAKE_OPERATOR, *others)}
    expected.update({submitter(rayjob): job_api, OPERATOR: job_api})
    return check(policies, ours, expected)


def manifests() -> dict:
    return {"raycluster": one("RayCluster"), "rayjob": one("RayJob"),
            "cluster_policies": [d for d in docs(KUBERAY / "networkpolicy.yaml") if d["kind"] == "NetworkPolicy"],
            "job_policies": [d for d in docs(KUBERAY / "rayjob.yaml") if d["kind"] == "NetworkPolicy"]}


def all_problems(m: dict) -> list[str]:
    return (raycluster_problems(m["raycluster"], m["cluster_policies"], m["rayjob"])
            + rayjob_problems(m["rayjob"], m["job_policies"], m["raycluster"]))


# -- tests --------------------------------------------------------------------------------------------
def test_the_evaluator_knows_the_rules():
    """The semantics the checks below rest on, on hand-made policies."""
    web = Pod("web", NAMESPACE, {"app": "web"}, {"http": 8080})
    deny = {"metadata": {}, "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"]}}
    assert open_ports([], web, INTERNET) == EVERY_PORT  # no policy: open
    assert open_ports([deny], web, NEIGHBOUR) == frozenset()  # selected, no rule: closed
    egress_only = copy.deepcopy(deny)
    egress_only["spec"]["policyTypes"] = ["Egress"]
    assert open_ports([egress_only], web, NEIGHBOUR) == EVERY_PORT
    named = {"metadata": {}, "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": "http"}]}]}}
    assert open_ports([deny, named], web, INTERNET) == {8080}  # additive; a named port resolves on the pod
    ranged = {"metadata": {}, "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": 9000, "endPort": 9002}]}]}}
    assert open_ports([ranged], web, INTERNET) == {9000, 9001, 9002}
    both = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NAMESPACE}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}
    assert admits(both, OPERATOR, NAMESPACE) and not admits(both, OPERATOR_NEIGHBOUR, NAMESPACE)
    assert not admits(both, FAKE_OPERATOR, NAMESPACE)
    assert not admits({"podSelector": {}}, INGRESS, NAMESPACE)  # podSelector alone: the policy's namespace
    assert admits({"namespaceSelector": {}}, INGRESS, NAMESPACE) and not admits({"namespaceSelector": {}}, INTERNET,
                                                                                  NAMESPACE)
    block = {"ipBlock": {"cidr": "198.51.100.0/24", "except": ["198.51.100.7/32"]}}
    assert not admits(block, INTERNET, NAMESPACE) and admits({"ipBlock": {"cidr": "0.0.0.0/0"}}, INTERNET, NAMESPACE)
    expr = {"matchExpressions": [{"key": "ray.io/node-type", "operator": "In", "values": ["head"]}]}
    assert selects(expr, {"ray.io/node-type": "head"}) and not selects(expr, {"ray.io/node-type": "worker"})


def test_kuberay_labels_its_pods_as_the_policies_expect():
    pods = {p.name: p for p in kuberay_pods(one("RayCluster")["spec"], "elastron")}
    assert set(pods) == {"elastron/headgroup", "elastron/cpu", "elastron/gpu-spot"}
    assert all(p.labels["ray.io/cluster"] == "elastron" for p in pods.values())
    assert pods["elastron/headgroup"].labels["ray.io/node-type"] == "head"
    assert pods["elastron/headgroup"].ports["api"] == api_port() == 8000
    # the RayJob's pods: its cluster name is not known in advance, so they carry the RayJob's name
    job = one("RayJob")
    for pod in kuberay_pods(job["spec"]["rayClusterSpec"], RAYJOB_CLUSTER):
        assert pod.labels["app.kubernetes.io/instance"] == job["metadata"]["name"], pod.name
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert int(head["rayStartParams"].get("dashboard-port", DASHBOARD_PORT)) == DASHBOARD_PORT
    assert next(p for p in head["template"]["spec"]["containers"][0]["ports"]
                if p["name"] == "dashboard")["containerPort"] == DASHBOARD_PORT


def test_every_policy_file_is_applied_with_its_cluster():
    import yaml

    assert "networkpolicy.yaml" in yaml.safe_load((KUBERAY / "kustomization.yaml").read_text())["resources"]
    assert manifests()["cluster_policies"] and manifests()["job_policies"]


def test_ray_ports_are_open_to_their_own_cluster_only_and_the_api_to_everyone():
    problems = all_problems(manifests())
    assert not problems, "\n".join(problems)


def _cluster_policy(m: dict, name: str) -> dict:
    return next(p for p in m["cluster_policies"] if p["metadata"]["name"] == name)


def _job_policy(m: dict, name: str) -> dict:
    return next(p for p in m["job_policies"] if p["metadata"]["name"] == name)


def _job_worker_labels(m: dict) -> dict:
    return m["rayjob"]["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]


BREAKAGES = {
    # a typo in the selector: no Ray pod is isolated, every port open to all
    "selector-typo": (lambda m: _cluster_policy(m, "elastron-ray")["spec"].update(
        podSelector={"matchLabels": {"ray.io/clusters": "elastron"}}), "selected by no NetworkPolicy"),
    # `from` dropped: Ray's ports open to everyone
    "no-from": (lambda m: _cluster_policy(m, "elastron-ray")["spec"]["ingress"][0].pop("from"),
                "reaches elastron/headgroup on every port"),
    # the same-cluster rule keyed on a label other clusters share: the RayJob's pods reach the GCS
    "shared-label": (lambda m: _cluster_policy(m, "elastron-ray")["spec"]["ingress"][0]["from"][0].update(
        podSelector={"matchLabels": {"app.kubernetes.io/name": "elastron"}}), f"{RAYJOB_CLUSTER}/headgroup reaches"),
    # the API opened on every pod of the cluster, workers included
    "api-on-workers": (lambda m: _cluster_policy(m, "elastron-api")["spec"]["podSelector"]["matchLabels"].pop(
        "ray.io/node-type"), "reaches elastron/gpu-spot on 8000"),
    # the dashboard opened instead of the API
    "wrong-port": (lambda m: _cluster_policy(m, "elastron-api")["spec"]["ingress"][0]["ports"][0].update(port=8265),
                   "reaches elastron/headgroup on 8265"),
    "egress-only": (lambda m: _cluster_policy(m, "elastron-ray")["spec"].update(policyTypes=["Egress"]),
                    "selected by no NetworkPolicy"),
    # the submitter allowed every port of the head
    "submitter-every-port": (lambda m: _job_policy(m, "elastron-llama-125m-job-api")["spec"]["ingress"][0].pop(
        "ports"), "submitter pod reaches elastron-llama-125m-x7k2p/headgroup on every port"),
    # the operator's namespace and pod selectors as two peers (a stray `-`): the whole namespace gets in
    "operator-peer-split": (lambda m: _job_policy(m, "elastron-llama-125m-job-api")["spec"]["ingress"][0][
        "from"].append({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": OPERATOR_NAMESPACE}}}),
        "another pod beside the operator reaches"),
    # a RayJob worker group without the label the job's policies select
    "job-worker-unlabelled": (lambda m: _job_worker_labels(m).pop("app.kubernetes.io/instance"),
                              "elastron-llama-125m-x7k2p/gpu-spot is selected by no NetworkPolicy"),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_broken_policies_fail_the_checks(name):
    m = copy.deepcopy(manifests())
    assert not all_problems(m)
    breakage, words = BREAKAGES[name]
    breakage(m)
    problems = all_problems(m)
    assert any(words in p for p in problems), problems
