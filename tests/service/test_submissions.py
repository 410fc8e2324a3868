"""The submissions (service.server.submissions.Submissions) alone, over a store and a fake launcher: a job
recorded and launched, an idempotent repeat, a failed launch, places held by another job, and the oldest
finished jobs forgotten (and said so)."""

from __future__ import annotations

import itertools

import pytest

from api.store import JobStore
from service.server.admission import Admission
from service.server.coordinators import Coordinators
from service.server.job_locks import JobLocks
from service.server.job_types import JobConflict
from service.server.scheduling import Scheduling
from service.server.submissions import Submissions

SPEC = {"name": "s", "data": {"source": "synthetic", "seq_len": 16},
        "train": {"steps": 10, "global_batch_size": 8, "micro_batch_size": 2}}


class Launcher:
    def __init__(self, fail: Exception | None = None):
        self.fail, self.launched = fail, []

    def launch(self, job):
        if self.fail is not None:
            raise self.fail
        self.launched.append(job.id)
        return object()


def submissions(tmp_path, launcher: Launcher, **kw) -> Submissions:
    store = JobStore(":memory:")
    admission = Admission(runs_root=tmp_path / "runs", data_roots=(), object_stores=(), resume_prefixes=(),
                          reserved=store.files(), azure_account=None)
    coordinators = Coordinators(launcher)
    ticks = itertools.count(5)  # one second per submit: the store lists by creation time
    return Submissions(store, admission, coordinators, JobLocks(), Scheduling(store, launcher, coordinators),
                       clock=lambda: float(next(ticks)), **kw)


def test_a_job_is_recorded_and_launched_and_a_repeat_gives_its_id(tmp_path):
    launcher = Launcher()
    s = submissions(tmp_path, launcher)
    first = s.submit(SPEC, owner="ann", idempotency_key="k")
    row = s.store.get(first.job_id)
    assert (row.state, row.owner, row.created, first.forgotten) == ("PENDING", "ann", 5.0, ())
    assert launcher.launched == [first.job_id] and s.coordinators.get(first.job_id) is not None
    assert s.submit(SPEC, owner="ann", idempotency_key="k").job_id == first.job_id
    assert launcher.launched == [first.job_id]  # not a second job
    with pytest.raises(JobConflict, match="Idempotency-Key 'k' was used for another request"):
        s.submit({**SPEC, "name": "other"}, owner="ann", idempotency_key="k")
    assert s.locks.known() == {first.job_id}  # the refused ones left no lock


def test_a_coordinator_that_cannot_be_launched_leaves_the_job_failed(tmp_path):
    s = submissions(tmp_path, Launcher(fail=RuntimeError("no Ray")))
    row = s.store.get(s.submit(SPEC).job_id)
    assert row.state == "FAILED" and row.released and "no Ray" in row.status.reason


def test_a_run_directory_another_job_holds_is_refused(tmp_path):
    s = submissions(tmp_path, Launcher())
    a = s.submit(SPEC, run_dir="shared").job_id
    with pytest.raises(JobConflict, match=f"the run_dir of job {a}"):
        s.submit(SPEC, run_dir="shared/inner")


def test_a_submit_forgets_the_owners_oldest_finished_jobs_beyond_the_limit(tmp_path):
    s = submissions(tmp_path, Launcher(fail=RuntimeError("no Ray")), max_finished_jobs=1)  # each ends FAILED
    first = s.submit(SPEC, owner="ann")
    second = s.submit(SPEC, owner="ann")
    assert first.forgotten == () and second.forgotten == ()  # one finished job (the first) is within the limit
    third = s.submit(SPEC, owner="ann")
    assert third.forgotten == (first.job_id,) and s.store.get(first.job_id) is None
    assert s.submit(SPEC, owner="bob").forgotten == ()  # per user
