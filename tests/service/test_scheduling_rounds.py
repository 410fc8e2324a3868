"""The scheduling rounds (service.server.scheduling.Scheduling) alone, over a store and fake coordinators:
off, no rounds; on, a queued job is granted the free workers once (not told again), a grant sent holds
its workers before the job's status shows it, and a deleted job's workers go to the others."""

from __future__ import annotations

from api.store import JobStore
from service.control.commands import Grant
from service.control.status import JobStatus
from service.pool.cluster import snapshot_from
from service.server.coordinators import Coordinators
from service.server.job_record import JobRecord
from service.server.scheduling import Scheduling

SPEC = {"name": "s", "data": {"source": "synthetic", "seq_len": 16},
        "train": {"steps": 10, "global_batch_size": 8, "micro_batch_size": 2},
        "parallel": {"min_workers": 1, "max_workers": 2}}


class Handle:
    def __init__(self):
        self.sent = []

    def send(self, cmd):
        self.sent.append(cmd)


class Launcher:
    def __init__(self, cpus: int):
        self.handles: dict[str, Handle] = {}
        self.cpus = cpus

    def attach(self, job_id):
        return self.handles.setdefault(job_id, Handle())

    def cluster(self):
        return snapshot_from([{"NodeID": "n1", "Alive": True, "Resources": {"CPU": float(self.cpus)}}], {}, now=0.0)

    def in_use(self, snap):
        return None


def queued(job_id: str, created: float) -> JobRecord:
    return JobRecord(id=job_id, name=job_id, spec=SPEC, run_dir=f"/runs/{job_id}", created=created, updated=created,
                     status=JobStatus(state="QUEUED", total_steps=10, grant={}))


def test_without_sharing_there_is_no_round_and_no_first_grant():
    s = Scheduling(JobStore(":memory:"), (launcher := Launcher(cpus=4)), Coordinators(launcher), shared=False)
    assert s.first_grant() is None and s.round() is None and s.last_round is None


def test_a_queued_job_is_granted_the_free_workers_once():
    store, launcher = JobStore(":memory:"), Launcher(cpus=3)
    coordinators = Coordinators(launcher)
    s = Scheduling(store, launcher, coordinators, shared=True)
    assert s.first_grant() == {}
    store.create(queued("a", 1.0))
    coordinators.attach("a")
    r = s.round()
    assert s.last_round is r
    (grant,) = launcher.handles["a"].sent
    assert isinstance(grant, Grant) and grant.nodes == {"n1": 2}  # its max_workers, of the node's free CPUs
    s.round()
    assert len(launcher.handles["a"].sent) == 1  # told once: the same grant is not sent again
    assert s.quota_usage() == []  # nobody has a quota, and nothing was seen held by the round before


def test_a_grant_sent_counts_before_the_jobs_status_shows_it():
    store, launcher = JobStore(":memory:"), Launcher(cpus=3)
    coordinators = Coordinators(launcher)
    s = Scheduling(store, launcher, coordinators, shared=True)
    store.create(queued("a", 1.0))
    coordinators.attach("a")
    s.round()  # a is granted 2 of the 3 workers; its stored status still shows no grant
    store.create(queued("b", 2.0))
    coordinators.attach("b")
    r = s.round()
    (grant,) = launcher.handles["b"].sent
    assert grant.nodes == {"n1": 1}  # the one worker a's grant leaves, not 2
    assert r.ledger.held("a").as_dict() == {"n1": 2}
    store.delete("a")  # a is gone: the next round gives its workers to b
    s.round()
    assert launcher.handles["b"].sent[-1].nodes == {"n1": 2}
