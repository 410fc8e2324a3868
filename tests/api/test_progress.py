"""The CLI's progress lines (`elastron run`, `elastron demo`) off a terminal: one per ~5% and per state
change, and a job that waits says what for."""

from __future__ import annotations

import io

from api.progress import Progress
from service.control.status import JobStatus


def test_a_waiting_job_says_what_it_waits_for_and_a_running_one_does_not():
    out = io.StringIO()
    p = Progress(100, stream=out)
    p.update(JobStatus(state="RUNNING", reason="running dp=2", step=1, loss=2.5, world_size=2,
                       layout={"dp_replicate": 2}))
    p.update(JobStatus(state="RUNNING", reason="running dp=2", step=2, loss=2.4, world_size=2))  # same 5%
    p.update(JobStatus(state="WAITING_FOR_CAPACITY", step=2, reason="no usable layout on 2 offered workers"))
    p.update(JobStatus(state="QUEUED", step=2, reason="3rd in the queue"))
    p.update(JobStatus(state="SUCCEEDED", reason="reached step 100", step=100, loss=2.1, world_size=0,
                       layout={"dp_replicate": 4}))  # a finished job's last layout is not a current one
    assert out.getvalue().splitlines() == [
        "step 1/100  loss 2.5000  layout 2rx1x1 (2 workers)  RUNNING",
        "step 2/100  layout - (0 workers)  WAITING_FOR_CAPACITY (no usable layout on 2 offered workers)",
        "step 2/100  layout - (0 workers)  QUEUED (3rd in the queue)",
        "step 100/100  loss 2.1000  SUCCEEDED",
    ]


def test_the_line_shows_val_loss_once_an_eval_has_run():
    out = io.StringIO()
    p = Progress(10, stream=out)
    p.update(JobStatus(state="RUNNING", reason="", step=1, loss=2.5, world_size=1))
    p.update(JobStatus(state="RUNNING", reason="", step=2, loss=2.4, val_loss=2.6, world_size=1))
    assert [line.split("  layout")[0] for line in out.getvalue().splitlines()] == [
        "step 1/10  loss 2.5000", "step 2/10  loss 2.4000  val_loss 2.6000"]
