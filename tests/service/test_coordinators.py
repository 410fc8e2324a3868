"""The coordinators' handles (service.server.coordinators.Coordinators) alone, over a fake launcher:
launched with a grant only when one is given, found again by attach, let go by release."""

from __future__ import annotations

from service.control.job import Job
from service.server.coordinators import Coordinators
from service.server.specs import validate_spec

SPEC = {"name": "c", "data": {"source": "synthetic", "seq_len": 16},
        "train": {"steps": 10, "global_batch_size": 8, "micro_batch_size": 2}}


class Launcher:
    def __init__(self):
        self.launched, self.released, self.found = [], [], {"old": "handle of old"}

    def launch(self, job, **grant):
        self.launched.append((job.id, grant))
        return f"handle of {job.id}"

    def attach(self, job_id):
        return self.found.get(job_id)

    def release(self, job_id, timeout_s=10.0):
        self.released.append((job_id, timeout_s))


def test_launch_attach_and_release():
    launcher = Launcher()
    c = Coordinators(launcher)
    cfg = validate_spec(SPEC)
    c.launch(Job.of(cfg, job_id="a", run_dir="/runs/a"), None)
    c.launch(Job.of(cfg, job_id="b", run_dir="/runs/b"), {})
    assert launcher.launched == [("a", {}), ("b", {"grant": {}})]  # no grant keyword for unscheduled jobs
    assert c.get("a") == "handle of a" and c.get("old") is None
    assert c.attach("old") == "handle of old" and c.get("old") == "handle of old"
    assert c.attach("never") is None
    c.release("a", 3.0)
    assert launcher.released == [("a", 3.0)] and c.get("a") is None
    c.drop_all()
    assert c.get("b") is None and c.get("old") is None
