"""The owner views (service.server.owner_views.OwnerViews) alone, over a store: a user sees their own jobs
only, reads name no other user's job, and the cluster is counts for a user."""

from __future__ import annotations

import pytest

from api.store import JobStore
from service.control.status import JobStatus
from service.pool.cluster import snapshot_from
from service.server.job_record import JobRecord
from service.server.job_types import JobNotFound
from service.server.owner_views import OwnerViews, redacted

ANN, BOB = "a0a0a0a0a0a0", "b0b0b0b0b0b0"


class Launcher:
    def cluster(self):
        return snapshot_from([{"NodeID": "head", "Alive": True, "Resources": {"CPU": 4.0}},
                              {"NodeID": "w1", "Alive": True, "Resources": {"CPU": 2.0, "GPU": 1.0}}], {}, now=7.0)


def views() -> OwnerViews:
    store = JobStore(":memory:")
    reason = f"shrunk 4→2 to admit job {BOB} (priority 10)"
    for job_id, owner in ((ANN, "ann"), (BOB, "bob")):
        store.create(JobRecord(id=job_id, name=owner, spec={}, run_dir=f"/runs/{owner}", created=1.0, updated=1.0,
                               owner=owner, status=JobStatus(state="RUNNING", reason=reason)))
    store.add_events(ANN, 0, [{"kind": "schedule", "time": 1.0, "step": None, "reason": reason}])
    return OwnerViews(store, Launcher(), clock=lambda: 9.0)


def test_a_user_sees_their_own_jobs_and_another_users_job_is_not_found():
    v = views()
    assert [r.id for r in v.list(owner="ann")] == [ANN]
    assert [r.id for r in v.list()] == [ANN, BOB]  # the admin sees all
    with pytest.raises(JobNotFound):
        v.get(BOB, owner="ann")
    with pytest.raises(JobNotFound):
        v.events(BOB, owner="ann")
    assert v.get(BOB, owner="bob").id == BOB


def test_a_users_reads_name_another_job_instead_of_another_users_job():
    v = views()
    assert v.get(ANN, owner="ann").status.reason == "shrunk 4→2 to admit another job"
    assert v.events(ANN, owner="ann")[0]["reason"] == "shrunk 4→2 to admit another job"
    assert v.get(ANN).status.reason == f"shrunk 4→2 to admit job {BOB} (priority 10)"  # the admin: as stored
    assert v.get(BOB, owner="bob").status.reason == f"shrunk 4→2 to admit job {BOB} (priority 10)"  # their own
    assert redacted({"a": [f"job {ANN} and job {BOB}"]}, {ANN}) == {"a": [f"job {ANN} and another job"]}


def test_the_cluster_is_counts_for_a_user_and_nodes_for_the_admin():
    v = views()
    admin = v.cluster()
    assert [n["node_id"] for n in admin["nodes"]] == ["head", "w1"]
    user = v.cluster(owner="ann")
    assert user["nodes"] == [] and (user["node_count"], user["cpus"], user["gpus"]) == (2, 6.0, 1.0)
