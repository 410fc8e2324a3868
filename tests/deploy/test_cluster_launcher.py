"""deploy/cluster-launcher/aws-spot.yaml: Ray's own cluster-config schema accepts it, the head is on-demand
and the GPU workers spot, torch==<pin> is installed before the project, and the spot watcher it starts
on every worker is given arguments its parser accepts. Who can reach the nodes: the security group Ray's
launcher code creates from the config (run against a mocked EC2) admits Ray's ports from the cluster's own
group only, and from outside only SSH and the Elastron API; Ray runs with token auth on every node; the
API serves behind its own token.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.deploy.helpers import LAUNCHER, pins, shell_commands


def test_spot_watcher_command_parses():
    from tools.spot_watcher import build_parser

    line = next(c for c in yaml.safe_load(LAUNCHER.read_text())["worker_start_ray_commands"] if "spot_watcher" in c)
    words = shlex.split(line.replace("$RAY_HEAD_IP", "10.0.0.1"))
    argv = words[words.index(next(w for w in words if w.endswith("spot_watcher.py"))) + 1:]
    argv = argv[:next(i for i, w in enumerate(argv) if w.startswith((">", "<", "&", "2>")))]
    args = build_parser().parse_args(argv)
    assert args.address == "10.0.0.1:6379" and args.pidfile


def test_launcher_config_validates_against_rays_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load(LAUNCHER.read_text())
    validate_config(prepare_config(copy.deepcopy(raw)))
    broken = copy.deepcopy(raw)
    broken["max_worker"] = 8  # a typo: Ray's schema rejects unknown keys
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(broken))


COMMAND_LISTS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                 "head_start_ray_commands", "worker_start_ray_commands")


def test_every_command_is_valid_shell():
    """bash -n on each command as the launcher would run it (a plain YAML scalar cut short at " #" is not)."""
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash not installed")
    cfg = yaml.safe_load(LAUNCHER.read_text())
    for key in COMMAND_LISTS:
        for cmd in cfg.get(key) or []:
            out = subprocess.run([bash, "-n", "-c", cmd], capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, f"{key}: {cmd!r}: {out.stderr}"


def test_launcher_has_an_on_demand_head_and_spot_gpu_workers_installing_torch_first():
    cfg = yaml.safe_load(LAUNCHER.read_text())
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert "InstanceMarketOptions" not in head["node_config"]
    assert head["resources"]["CPU"] == 0
    workers = [t for name, t in types.items() if name != cfg["head_node_type"]]
    assert workers and all(t["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot" for t in workers)
    assert all(0 < t["min_workers"] <= t["max_workers"] <= cfg["max_workers"] for t in workers)
    setup = cfg["setup_commands"]
    torch_i = next(i for i, c in enumerate(setup) if f"torch=={pins()['torch']}" in c)
    project_i = next(i for i, c in enumerate(setup) if re.search(r"pip install .*~/elastron", c))
    assert torch_i < project_i
    assert cfg["file_mounts"]["~/elastron"] == "."
    assert any("spot_watcher.py" in c for c in cfg["worker_start_ray_commands"])


# -- who can reach the nodes --------------------------------------------------------------------------
# Ports Ray listens on (GCS, dashboard/job API, client, object manager as pinned, dashboard agent, metrics,
# the default worker-port range's ends, a random one for the node manager and the like).
RAY_PORTS = {6379: "GCS", 8265: "dashboard/job API", 10001: "Ray client", 8076: "object manager",
             52365: "dashboard agent", 8080: "metrics", 10002: "worker ports", 19999: "worker ports",
             41234: "node manager (random)"}
SSH = 22  # the launcher's own way in; Ray adds it to the group it creates, from anywhere, key-only
EVERYWHERE = {"0.0.0.0/0", "::/0"}


def _ports(perm: dict) -> range:
    if perm["IpProtocol"] in ("-1", "all") or perm.get("FromPort", -1) == -1:
        return range(0, 65536)
    return range(perm["FromPort"], perm["ToPort"] + 1)


def exposure_problems(perms: list[dict], own: set[str], api_port: int) -> list[str]:
    """What is wrong with a security group's inbound rules `perms` for a Ray cluster whose nodes are in the
    groups `own`: Ray's ports must be reachable from `own` (every port, as Ray picks some at random) and
    from nothing else; from outside, only SSH and the Elastron API, the API not from everywhere."""
    problems = []
    if not any(_ports(p) == range(0, 65536) and own & {g["GroupId"] for g in p.get("UserIdGroupPairs", [])}
               for p in perms):
        problems.append("no rule lets the cluster's own group reach every port: Ray's nodes cannot talk")
    for p in perms:
        sources = ([r["CidrIp"] for r in p.get("IpRanges", [])] + [r["CidrIpv6"] for r in p.get("Ipv6Ranges", [])]
                   + [r["PrefixListId"] for r in p.get("PrefixListIds", [])]
                   + [g["GroupId"] for g in p.get("UserIdGroupPairs", []) if g["GroupId"] not in own])
        if not sources:
            continue
        ports = _ports(p)
        exposed = {port: what for port, what in RAY_PORTS.items() if port in ports}
        if exposed or (ports.start, ports.stop) not in ((SSH, SSH + 1), (api_port, api_port + 1)):
            problems.append(f"{sources} reach ports {ports.start}-{ports.stop - 1}"
                            + (f", Ray's {sorted(set(exposed.values()))}" if exposed else ""))
        if api_port in ports and EVERYWHERE & set(sources):
            problems.append(f"the Elastron API ({api_port}) is open to {sorted(EVERYWHERE & set(sources))}")
    return problems


def serve_line(cfg: dict) -> tuple[str, list[str]]:
    """The head_start_ray_commands entry that starts `elastron serve`, and the arguments it gives serve."""
    (found,) = [(c, a[2:]) for c in cfg["head_start_ray_commands"] for a in shell_commands(c)
                if Path(a[0]).name == "elastron" and a[1:2] == ["serve"]]
    return found


def api_port(cfg: dict) -> int:
    from api.cli import build_parser

    return build_parser().parse_args(["serve", *serve_line(cfg)[1]]).port


def _rules_ray_would_create(cfg: dict, own: str = "sg-cluster") -> list[dict]:
    from ray.autoscaler._private.aws.config import _create_default_inbound_rules

    return _create_default_inbound_rules({own}, cfg["provider"].get("security_group", {}).get("IpPermissions", []))


def test_security_group_keeps_rays_ports_to_the_cluster(monkeypatch):
    """Ray's own launcher code (the pinned Ray's _configure_subnet and _configure_security_group, as `ray up`
    runs them) against a mocked EC2: the group it creates for the nodes admits Ray's ports from itself only."""
    pytest.importorskip("moto")
    import boto3
    from moto import mock_aws
    from ray.autoscaler._private.aws import config as aws_config
    from ray.autoscaler._private.aws import utils as aws_utils
    from ray.autoscaler._private.util import prepare_config

    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
                 "AWS_DEFAULT_REGION": "us-west-2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    caches = (aws_utils.resource_cache, aws_utils.client_cache, aws_config._get_subnets_or_die)
    raw = yaml.safe_load(LAUNCHER.read_text())
    for c in caches:  # boto objects Ray cached outside this mock would reach for the real AWS
        c.cache_clear()
    try:
        with mock_aws():
            cfg = aws_config._configure_security_group(aws_config._configure_subnet(prepare_config(copy.deepcopy(raw))))
            ids = {t: t_cfg["node_config"]["SecurityGroupIds"] for t, t_cfg in cfg["available_node_types"].items()}
            groups = boto3.client("ec2", region_name=cfg["provider"]["region"]).describe_security_groups(
                GroupIds=sorted({i for v in ids.values() for i in v}))["SecurityGroups"]
    finally:
        for c in caches:
            c.cache_clear()
    assert [g["GroupName"] for g in groups] == [raw["provider"]["security_group"]["GroupName"]]
    own = {groups[0]["GroupId"]}
    assert all(set(v) == own for v in ids.values()), ids  # head and workers in the one group
    problems = exposure_problems(groups[0]["IpPermissions"], own, api_port(raw))
    assert not problems, problems
    assert any(api_port(raw) in _ports(p) and p.get("IpRanges") for p in groups[0]["IpPermissions"]), \
        "the Elastron API should be reachable from the configured range"


SG_BREAKAGES = {
    "dashboard-to-the-world": ({"IpProtocol": "tcp", "FromPort": 8265, "ToPort": 8265,
                                "IpRanges": [{"CidrIp": "0.0.0.0/0"}]}, "dashboard/job API"),
    "gcs-to-a-range": ({"IpProtocol": "tcp", "FromPort": 6379, "ToPort": 6379,
                        "IpRanges": [{"CidrIp": "203.0.113.0/24"}]}, "GCS"),
    "everything-to-a-peer-group": ({"IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": "sg-other"}]}, "sg-other"),
    "api-to-the-world": ({"IpProtocol": "tcp", "FromPort": 8000, "ToPort": 8000,
                          "Ipv6Ranges": [{"CidrIpv6": "::/0"}]}, "open to ['::/0']"),
    "client-port-range": ({"IpProtocol": "tcp", "FromPort": 10000, "ToPort": 10010,
                           "IpRanges": [{"CidrIp": "203.0.113.0/24"}]}, "Ray client"),
}


@pytest.mark.parametrize("name", SG_BREAKAGES)
def test_exposure_check_rejects_open_ray_ports(name):
    cfg = yaml.safe_load(LAUNCHER.read_text())
    assert not exposure_problems(_rules_ray_would_create(cfg), {"sg-cluster"}, api_port(cfg))
    rule, words = SG_BREAKAGES[name]
    cfg["provider"]["security_group"]["IpPermissions"].append(rule)
    problems = exposure_problems(_rules_ray_would_create(cfg), {"sg-cluster"}, api_port(cfg))
    assert any(words in p for p in problems), problems


def test_no_node_brings_its_own_security_group():
    """A node_config with SecurityGroupIds makes Ray skip its group (and the rules checked above)."""
    cfg = yaml.safe_load(LAUNCHER.read_text())
    for name, t in cfg["available_node_types"].items():
        assert "SecurityGroupIds" not in t["node_config"] and "NetworkInterfaces" not in t["node_config"], name
    assert "LaunchTemplate" not in str(cfg)


def test_ray_token_auth_on_every_node():
    """Every node runs Ray with RAY_AUTH_MODE=token and has the token where Ray looks for it by default."""
    from ray._private.authentication.authentication_token_setup import _get_default_token_path
    from ray.autoscaler._private.command_runner import _with_interactive

    cfg = yaml.safe_load(LAUNCHER.read_text())
    home_token = "~/" + str(_get_default_token_path().relative_to(Path.home()))
    assert cfg["file_mounts"].get(home_token) == home_token, "Ray's token must reach every node"
    # the launcher runs every command through `bash -i`, sourcing ~/.bashrc first ...
    assert "source ~/.bashrc;" in _with_interactive("true")[-1]
    # ... where setup_commands (which run before any start command) export token mode
    bashrc = [shlex.split(line) for c in cfg["setup_commands"]
              for line in re.findall(r"echo '([^']*)' >> ~/\.bashrc", c)]
    assert ["export", "RAY_AUTH_MODE=token"] in [words[:2] for words in bashrc], bashrc
    (head,) = [a for c in cfg["head_start_ray_commands"] for a in shell_commands(c) if a[:2] == ["ray", "start"]]
    assert "--dashboard-host=127.0.0.1" in head, "the dashboard (job API) listens on the head's loopback only"


def test_api_runs_behind_its_token_on_the_port_the_security_group_opens():
    from api.cli import build_parser

    cfg = yaml.safe_load(LAUNCHER.read_text())
    line, argv = serve_line(cfg)
    args = build_parser().parse_args(["serve", *argv])
    assert args.host == "0.0.0.0" and not args.insecure and args.address == "auto"
    token_file = re.search(r"export ELASTRON_API_TOKEN=\$\(cat (\S+)\)", line)[1]
    made = [c for c in cfg["head_setup_commands"] if token_file in c and "umask 077" in c]
    assert made, f"no head_setup_command makes {token_file} readable by its owner only"
    assert token_file not in cfg["file_mounts"], "the API token stays on the head"
    assert any(api_port(cfg) in _ports(p) for p in cfg["provider"]["security_group"]["IpPermissions"])
    # a re-run of `ray up` stops the previous server before starting the next (its pidfile)
    pidfile = re.search(r"--pidfile (\S+)", line)[1]
    first = cfg["head_start_ray_commands"][0]
    assert "--stop" in first and pidfile in first
