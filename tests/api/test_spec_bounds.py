"""Issue 52, shown by attack: the spec fields the fourth review found unbounded (findings 1, 4, 5, 9, and
data.num_samples), each replayed over HTTP against a live server with a user's token. Each is refused by
the spec's own schema (workers.config) with a 422 that names the field in one line, within 1 s, before
anything looks at the disk or plans, and without repeating the input back."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from api.app import create_app
from api.deps import Settings
from api.store import JobStore
from service.server.job_manager import JobManager
from tests.api.helpers import SPEC, HandleLauncher, live_server

J = "/api/v1/jobs"
ALICE = "al1ce-t0ken"


class _Idle:
    """A coordinator that is never asked anything here: every request below is refused before one starts."""

    def status(self):  # pragma: no cover - nothing is admitted
        raise AssertionError("a refused spec reached a coordinator")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("bounds")
    (root / "data").mkdir()
    s = Settings(runs_root=root / "runs", store_url=str(root / "jobs.db"), token="adm1n-t0ken",
                 user_tokens={"alice": ALICE}, data_roots=(root / "data",), sync_interval_s=0.05, schedule=False)
    mgr = JobManager(JobStore(s.store_url), HandleLauncher(lambda job: _Idle()), runs_root=s.runs_root,
                     data_roots=s.data_roots, sync_interval_s=s.sync_interval_s)
    with live_server(create_app(jobs=mgr, settings=s)) as url, \
            httpx.Client(base_url=url, timeout=20, headers={"Authorization": f"Bearer {ALICE}"}) as c:
        yield c


def spec_with(section: str, **fields) -> dict:
    out = json.loads(json.dumps(SPEC))
    if section:
        out[section] = {**out.get(section, {}), **fields}
    else:
        out.update(fields)
    return out


DIGITS_401 = int("9" * 401)

FINDINGS = [
    # (id, spec, the field the 422 must name, a part of its message)
    ("1-standby-1000000", spec_with("resources", standby_per_node=1_000_000), ["resources", "standby_per_node"],
     "at most 4"),
    ("1-standby-401-digits", spec_with("resources", standby_per_node=DIGITS_401), ["resources", "standby_per_node"],
     "a 401-digit number"),
    ("9-eval-batches-401-digits", spec_with("train", eval_batches=DIGITS_401), ["train", "eval_batches"],
     "at most 10000"),
    ("9-eval-interval-401-digits", spec_with("train", eval_interval=DIGITS_401), ["train", "eval_interval"],
     "at most 1000000000000"),
    ("5-name-1MB", spec_with("", name="n" * 1_000_000), ["name"], "has 1000000 characters; at most 128"),
    ("4-data-path-900KB", spec_with("data", source="corpus", path="/etc/" + "a/" * 450_000), ["data", "path"],
     "has 900005 characters; at most 4096"),
    ("4-val-path-900KB", spec_with("data", source="corpus", val_path="/etc/" + "a/" * 450_000), ["data", "val_path"],
     "at most 4096"),
    ("4-checkpoint-dir-900KB", spec_with("checkpoint", dir="s3://ckpts/" + "a/" * 450_000), ["checkpoint", "dir"],
     "at most 4096"),
    ("num-samples-2**40", spec_with("data", source="synthetic", num_samples=2**40), ["data", "num_samples"],
     "at most 67108864"),
]


@pytest.mark.parametrize("spec,loc,why", [f[1:] for f in FINDINGS], ids=[f[0] for f in FINDINGS])
def test_each_unbounded_field_of_the_review_is_a_422_naming_it_without_doing_the_work(client, spec, loc, why):
    t0 = time.perf_counter()
    r = client.post(J, json={"spec": spec})
    took = time.perf_counter() - t0
    assert r.status_code == 422, r.text[:500]
    (err,) = r.json()["detail"]
    assert err["loc"] == ["body", "spec", *loc] and why in err["msg"] and "\n" not in err["msg"], err
    assert len(r.content) < 2000  # the input is named, not repeated
    # a guard against a refusal that does the work first (a 900 KB path resolved, 2^40 samples shuffled:
    # minutes); the 1 s target is measured in benchmarks/abuse.py, not here, on a box shared with other work
    assert took < 10.0, f"refused after {took:.2f} s"
    assert client.get(J).json() == []


def test_the_bounds_leave_the_defaults_and_the_largest_values_accepted(client):
    """The bounds refuse only what is past them: at the bound, a spec parses (nothing is submitted, so no
    job starts: the schema is judged through validate_spec's parser, the same one the route uses)."""
    from service.server.specs import validate_spec

    cfg = validate_spec({**SPEC, "name": "n" * 128, "resources": {"standby_per_node": 4},
                         "train": {**SPEC["train"], "eval_batches": 10_000, "eval_interval": 10**12},
                         "data": {**SPEC.get("data", {}), "source": "synthetic", "num_samples": 2**26}})
    assert cfg.resources.standby_per_node == 4 and cfg.train.eval_batches == 10_000 and len(cfg.name) == 128
