"""The job commands (service.server.job_commands) alone, over a store and fake coordinators: which
command fits which state (a literal table), a command delivered, one refused by its state, and a delete
that stops, releases and forgets the job."""

from __future__ import annotations

import pytest

from api.store import JobStore
from service.control.commands import Pause, Resume, SetWorkers, Stop
from service.control.status import JobStatus
from service.server.coordinators import Coordinators
from service.server.job_commands import JobCommands, conflict
from service.server.job_locks import JobLocks
from service.server.job_record import JobRecord
from service.server.job_types import JobConflict, JobNotFound
from service.server.owner_views import OwnerViews
from service.server.store_sync import StoreSync


@pytest.mark.parametrize("cmd, state, why", [
    (SetWorkers(min_workers=1, max_workers=2), "RUNNING", None),
    (SetWorkers(min_workers=1, max_workers=2), "SUCCEEDED", "a finished job cannot be resized"),
    (Pause(), "RUNNING", None),
    (Pause(), "PAUSED", "it is already paused"),
    (Pause(), "FAILED", "a finished job cannot be paused"),
    (Resume(), "PAUSED", None),
    (Resume(), "RUNNING", "only a PAUSED job can be resumed"),
    (Stop(), "QUEUED", None),
    (Stop(), "STOPPED", "it has already finished"),
])
def test_which_command_fits_which_state(cmd, state, why):
    assert conflict(cmd, state) == why


class Handle:
    def __init__(self):
        self.state, self.sent = "RUNNING", []

    def status(self):
        return JobStatus(state=self.state, total_steps=10)

    def events_since(self, index=0):
        return []

    def metrics_since(self, step=0):
        return []

    def send(self, cmd):
        self.sent.append(cmd)
        if isinstance(cmd, Stop):
            self.state = "STOPPED"


class Launcher:
    def __init__(self):
        self.handle, self.released = Handle(), []

    def attach(self, job_id):
        return self.handle

    def release(self, job_id, timeout_s=10.0):
        self.released.append(job_id)


def commands() -> tuple[JobCommands, Launcher]:
    store, launcher, locks = JobStore(":memory:"), Launcher(), JobLocks(1.0)
    store.create(JobRecord(id="a", name="a", spec={}, run_dir="/runs/a", created=1.0, updated=1.0, owner="ann",
                           status=JobStatus(state="RUNNING", total_steps=10)))
    coordinators = Coordinators(launcher)
    syncer = StoreSync(store, coordinators, locks, sync_interval_s=0.05, stop_timeout_s=1.0, clock=lambda: 2.0)
    return JobCommands(store, coordinators, locks, syncer, OwnerViews(store, launcher, clock=lambda: 2.0),
                       stop_timeout_s=1.0), launcher


def test_a_command_is_delivered_and_one_the_state_rules_out_is_a_conflict():
    c, launcher = commands()
    assert c.command("a", Pause(), owner="ann") == {"id": "a", "action": "pause", "accepted": True, "state": "RUNNING"}
    assert launcher.handle.sent == [Pause()]
    with pytest.raises(JobNotFound):
        c.command("a", Pause(), owner="bob")  # not bob's job
    with pytest.raises(JobConflict, match="cannot resume job a: it is RUNNING; only a PAUSED job can be resumed"):
        c.command("a", Resume(), owner="ann")
    assert launcher.handle.sent == [Pause()]


def test_delete_stops_the_job_releases_its_coordinator_and_forgets_it():
    c, launcher = commands()
    out = c.delete("a", owner="ann")
    assert out == {"id": "a", "state": "STOPPED", "deleted": True, "run_dir": "/runs/a"}
    assert launcher.handle.sent == [Stop()] and "a" in launcher.released
    assert c.store.get("a") is None and "a" not in c.locks.known()
