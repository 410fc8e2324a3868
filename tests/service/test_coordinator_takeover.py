"""A REST job's workers outlive its coordinator: they are detached actors, so when the coordinator's
process dies (SIGKILL), Ray restarts it and the new coordinator takes them over: their group trains on
as it is (or, if one of them cannot, the group heals from the others' state): no worker process is
started, no step is redone. When the coordinator is gone for good, the
workers end themselves and give their slots back. Real workers (tiny model, gloo) on one local Ray."""

from __future__ import annotations

import os
import signal

import pytest

from api.store import JobStore
from service.server.job_actor import NAMESPACE, RayLauncher, actor_name
from service.server.job_manager import JobManager
from tests.api.helpers import wait_for
from tests.ray_local import local_ray  # noqa: F401  (a fixture)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.e2e

SPEC = {"name": "tiny", "data": {"source": "synthetic", "seq_len": 16},
        "train": {"steps": 150, "global_batch_size": 8, "micro_batch_size": 2},
        "parallel": {"min_workers": 2, "max_workers": 2}, "checkpoint": {"interval_steps": 100},
        "resources": {"cpus_per_worker": 1}}


def worker_names(job_id: str) -> list[str]:
    """The job's detached workers that Ray lists as alive."""
    return sorted(e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
                  if e["namespace"] == NAMESPACE and e["name"].startswith(f"elastron-worker-{job_id}-"))


def workers_of(job_id: str, *, standby: bool = False) -> dict[str, int]:
    """{actor name: pid} of the job's detached workers (while it trains: none is ending): its members,
    or with `standby` its standbys (idle, holding no placement group)."""
    infos = {n: ray.get(ray.get_actor(n, namespace=NAMESPACE).info.remote(), timeout=30)
             for n in worker_names(job_id)}
    return {n: i.pid for n, i in infos.items() if (i.pg is None) == standby}


@pytest.fixture
def manager(local_ray, tmp_path):
    mgr = JobManager(JobStore(tmp_path / "jobs.db"), RayLauncher(timeout_s=60, options={"settle_seconds": 0.0}),
                     runs_root=tmp_path / "runs", sync_interval_s=0.1)
    mgr.start()
    yield mgr
    mgr.close()


def test_a_restarted_coordinator_takes_over_the_workers_it_left_running(manager):
    steps = 400  # the standby starts while the job trains (~2 s): enough steps left to kill it after that
    job_id = manager.submit({**SPEC, "train": {**SPEC["train"], "steps": steps}})
    wait_for(lambda: len(workers_of(job_id, standby=True)) == 1, timeout=120, what="a standby started")
    standby = workers_of(job_id, standby=True)
    first = wait_for(lambda: (j := manager.get(job_id).status).step >= 10 and j, timeout=120, what="training")
    before = workers_of(job_id)
    assert len(before) == 2

    os.kill(first.pid, signal.SIGKILL)
    wait_for(lambda: (j := manager.get(job_id).status).pid not in (None, first.pid) and j.state == "RUNNING"
             and j.step > first.step + 5, timeout=120, what="the restarted coordinator trains on")
    after = workers_of(job_id)
    # The same processes: taken over, not started again. A race the kill can win: a coordinator killed
    # between sending a step to one member and to the other leaves the first waiting in a collective for
    # a peer that never joins. The group is then salvaged: the peer's salvage destroys and collects its
    # process group, which frees the waiting member (kept, nothing stopped); should that member still not
    # answer, it is stopped and a standby takes its place.
    notes = [e for e in manager.events(job_id) if e["kind"] == "info" and "stopped" in e["details"]]
    stuck = notes[0]["details"]["stopped"] if notes else []
    assert stuck in ([], ["it did not answer"]), stuck
    log = "\n".join(f"{e['kind']}: {e.get('reason')} {e.get('details')}" for e in manager.events(job_id))
    assert len(after) == 2 and len(set(after.values()) & set(before.values())) == 2 - len(stuck), log
    # the standby is taken over as one (or, if it did not answer within the takeover's 0.1 s, replaced):
    # made a member only in a stuck member's place
    assert len(set(standby.values()) & set(after.values())) <= len(stuck)
    wait_for(lambda: len(workers_of(job_id, standby=True)) == 1, timeout=60, what="a standby beside the members")

    done = wait_for(lambda: (j := manager.get(job_id).status).state in ("SUCCEEDED", "FAILED") and j,
                    timeout=120, what="the job ends")
    assert done.state == "SUCCEEDED", done.reason
    assert done.step == steps and done.steps_lost == 0 and done.reconfigurations.get("failure") == 1
    events = manager.events(job_id)
    heal = [e for e in events if e["kind"] == "resize"][-1]["details"]
    # the group trains on as it is; after the race above it cannot, and heals from its members' state
    assert heal["transfer"]["path"] in (("peers",) if stuck else ("in place", "peers")) and heal["cause"] == "failure"
    # no process started, but in a stuck member's place (a standby, if one had answered the takeover)
    assert heal["started"] == len(stuck) and heal["transfer"].get("standby", 0) <= len(stuck)
    assert any(e["kind"] == "info" and e["details"].get("adopted") == 2 for e in events)
    assert [m["step"] for m in manager.metrics(job_id)] == list(range(1, steps + 1))
    wait_for(lambda: not worker_names(job_id), timeout=30, what="the finished job's workers end")


def test_a_worker_that_died_with_the_coordinator_gives_its_slot_back(manager):
    """The coordinator and one worker die together: the new coordinator takes the other over and
    removes the dead one's placement group, which no one else would (it was detached), so the job can
    grow back onto its slot."""
    job_id = manager.submit(SPEC)
    first = wait_for(lambda: (j := manager.get(job_id).status).step >= 10 and j, timeout=120, what="training")
    pids = sorted(workers_of(job_id).values())
    os.kill(first.pid, signal.SIGKILL)
    os.kill(pids[0], signal.SIGKILL)

    done = wait_for(lambda: (j := manager.get(job_id).status).state in ("SUCCEEDED", "FAILED") and j,
                    timeout=180, what="the job ends")
    assert done.state == "SUCCEEDED", done.reason
    after = [e["details"] for e in manager.events(job_id) if e["kind"] == "resize"][1]
    # from the survivor's state, or (where the peer's death broke its step after the weight update)
    # from the last commit, through the survivor's process; the dead one replaced on the slot it held
    assert after["world_size"] == 2 and after["started"] == 1 and after["cause"] == "failure"
    wait_for(lambda: all(t["state"] == "REMOVED" for t in ray.util.placement_group_table().values()),
             timeout=30, what="every placement group removed")


def test_workers_end_themselves_once_their_coordinator_is_gone_for_good(manager):
    job_id = manager.submit(SPEC)
    wait_for(lambda: manager.get(job_id).status.step >= 5, timeout=120, what="training")
    assert len(workers_of(job_id)) == 2
    wait_for(lambda: len(workers_of(job_id, standby=True)) == 1, timeout=60, what="a standby started")

    ray.kill(ray.get_actor(actor_name(job_id), namespace=NAMESPACE), no_restart=True)  # no restart: gone
    wait_for(lambda: not worker_names(job_id), timeout=30, what="the orphaned workers end")
    wait_for(lambda: ray.available_resources().get("CPU") == 2.0, timeout=30, what="their CPUs come back")
