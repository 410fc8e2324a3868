"""deploy/cluster-launcher/aws-spot.yaml: Ray's own cluster-config schema accepts it, the head is on-demand
and the GPU workers spot, torch==<pin> is installed before the project, and the spot watcher it starts
on every worker is given arguments its parser accepts.
"""

from __future__ import annotations

import copy
import re
import shlex

import jsonschema
import pytest
import yaml

from tests.deploy.helpers import LAUNCHER, pins


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
