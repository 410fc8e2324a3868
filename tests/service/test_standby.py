"""Standby workers: idle processes a group keeps started on its members' nodes, reserving nothing, so
that a member that crashed is replaced without a process start (the chaos benchmark's worker kills spent
~2.5 s of their ~3.1 s recovery starting the replacement, mostly importing torch)."""

from __future__ import annotations

import os
import time

import pytest

from service.control.failure import fate
from service.pool.group import WorkerFailure
from service.pool.worker_group import Role, WorkerGroup, WorkerHandle
from tests.ray_local import local_ray  # noqa: F401  (a fixture)
from workers.config import JobConfig
from workers.report import WorkerInfo

ray = pytest.importorskip("ray")
from ray.util import placement_group_table  # noqa: E402
pytestmark = pytest.mark.e2e


def _cpus_free(n: float, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s  # resource release is asynchronous
    while ray.available_resources().get("CPU", 0.0) != n:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.05)


def _settled_standby(g: WorkerGroup) -> WorkerInfo:
    (standby,) = g.standby
    return ray.get(standby.ping, timeout=60)


def test_a_crashed_member_is_replaced_by_the_standby_which_then_holds_the_slot(local_ray, tmp_path):
    me = ray.get_runtime_context().get_node_id()
    g = WorkerGroup(JobConfig(), str(tmp_path), cpus_per_worker=1, gpus_per_worker=0, job_id="t")
    try:
        g.scale_to([me])
        assert g.keep_standby() == 1 and g.keep_standby() == 0  # one per node hosting members
        standby = _settled_standby(g)
        assert standby.pg is None and standby.node_id == me
        assert standby.warmed.first_step_s > 0  # paid while it waited
        _cpus_free(1.0)  # the member holds one CPU, the standby none
        crashed = g.members[0]
        slot = crashed.pg.id
        ray.kill(crashed.actor, no_restart=True)
        assert g.salvage(fate=fate).kept == {}  # the dead member is lost; its slot is kept for the next start
        start = g.scale_to([me])
        assert (start.started, start.stopped) == (1, 0)
        (m,) = g.members
        assert ray.get(m.actor.info.remote(), timeout=30).pid == standby.pid  # no new process
        assert m.pg is not None and ray.get(m.actor.info.remote(), timeout=30).pg.id == m.pg.id
        assert m.pg.id == slot  # claimed with the slot the dead member left: no new placement group
        _cpus_free(1.0)  # the claimed standby's placement group holds the slot
        assert g.standby == [] and g.keep_standby() == 1  # replenished
        _settled_standby(g)
    finally:
        g.shutdown()
    _cpus_free(2.0)
    assert g.standby == []


def test_a_dead_standby_is_replaced_standbys_leave_nodes_without_members_none_for_gpu_workers(local_ray, tmp_path):
    me = ray.get_runtime_context().get_node_id()
    g = WorkerGroup(JobConfig(), str(tmp_path), cpus_per_worker=1, gpus_per_worker=0, job_id="t2")
    try:
        g.scale_to([me])
        g.keep_standby()
        crashed = _settled_standby(g).pid
        os.kill(crashed, 9)  # a standby that dies is replaced, and is no failure of the group
        deadline = time.monotonic() + 30
        while g.keep_standby() == 0:
            assert time.monotonic() < deadline, "the dead standby was not replaced"
            time.sleep(0.1)
        pid = _settled_standby(g).pid
        assert pid != crashed and len(g.members) == 1
        g.scale_to([])
        assert g.keep_standby() == 0 and g.standby == []
        deadline = time.monotonic() + 15
        while _alive(pid):
            assert time.monotonic() < deadline, f"standby {pid} still running"
            time.sleep(0.1)
    finally:
        g.shutdown()
    gpu = WorkerGroup(JobConfig(), str(tmp_path), cpus_per_worker=1, gpus_per_worker=1, job_id="t3")
    gpu.workers = g.workers  # no member: keep_standby must not need a GPU to decide
    assert gpu.keep_standby() == 0


def _removed(slot) -> bool:
    """Whether Ray has removed the placement group `slot`, polled: the GCS removes one asynchronously, so
    right after `remove_placement_group` its table may still say CREATED."""
    deadline = time.monotonic() + 15
    while placement_group_table(slot)["state"] != "REMOVED":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_slot_a_dead_member_left_is_held_until_the_next_start_only_and_not_on_a_dead_node(local_ray, tmp_path):
    me = ray.get_runtime_context().get_node_id()
    g = WorkerGroup(JobConfig(), str(tmp_path), cpus_per_worker=1, gpus_per_worker=0, job_id="t6")
    try:
        g.scale_to([me])
        slot = g.members[0].pg
        ray.kill(g.members[0].actor, no_restart=True)
        g.salvage(fate=fate)
        assert placement_group_table(slot)["state"] == "CREATED"  # held for a start on this node
        g.scale_to([])  # the start that followed did not take it: given back
        assert _removed(slot)
        g.scale_to([me])
        slot = g.members[0].pg
        ray.kill(g.members[0].actor, no_restart=True)
        g.salvage(fate=fate, gone={me})  # a member on a node the watcher lists as dead: no slot kept there
        assert _removed(slot)
    finally:
        g.shutdown()
    _cpus_free(2.0)


def test_a_growths_spare_warms_up_says_so_and_gets_its_standby_once_a_member(local_ray, tmp_path):
    """A growth's spare warms up (`Worker.warm_up`), and `warm` says so once it has: the growth waits for
    that while the group trains. Its node gets no standby before the spare is a member: the spare's start
    and warm-up have the node to themselves."""
    me = ray.get_runtime_context().get_node_id()
    g = WorkerGroup(JobConfig(), str(tmp_path), cpus_per_worker=1, gpus_per_worker=0, job_id="t7")
    try:
        assert g.prewarm([me]) == 1 and g.size == 0
        assert g.keep_standby() == 0
        deadline = time.monotonic() + 60
        while not g.warm([me]):
            assert time.monotonic() < deadline, "the spare never reported warm"
            time.sleep(0.05)
        assert ray.get(g.spares[0].ping).warmed is not None and not g.warm([me, me])
        assert g.prewarm([me]) == 0  # it has its spare
        g.scale_to([me])  # the growth takes the spare; now its node gets a standby
        assert (g.size, g.keep_standby(), g.keep_standby()) == (1, 1, 0)
    finally:
        g.shutdown()
    _cpus_free(2.0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_after_a_failure_that_kept_no_member_the_standbys_are_claimed(local_ray, tmp_path):
    """A recovery that keeps no member stops them all (`stop_members`), not the standbys: the re-form
    claims those instead of starting every worker afresh (seen in chaos: a double fault restarted all)."""
    me = ray.get_runtime_context().get_node_id()
    g = WorkerGroup(JobConfig(), str(tmp_path), cpus_per_worker=1, gpus_per_worker=0, job_id="t4")
    try:
        g.scale_to([me])
        g.keep_standby()
        standby = _settled_standby(g)
        slot = g.members[0].pg
        g.stop_members()
        assert g.size == 0 and len(g.standby) == 1
        assert placement_group_table(slot)["state"] == "CREATED"  # left for the start, not removed
        start = g.scale_to([me])
        assert (start.started, start.stopped) == (1, 0) and start.from_standby == 1
        assert ray.get(g.members[0].actor.info.remote(), timeout=30).pid == standby.pid
        assert g.members[0].pg.id == slot.id  # claimed with the stopped member's slot: nothing placed anew
    finally:
        g.shutdown()
    _cpus_free(2.0)


def test_a_start_that_fails_keeps_the_workers_that_came_up_as_spares_for_the_next(local_ray, tmp_path, monkeypatch):
    """A recovery's start that fails (a second fault: another worker of it died) keeps the standby it
    claimed, which came up, as a spare; the failure's `stop_members` keeps it too, and the next start takes
    it instead of a process start (seen in chaos: a double fault's second recovery started one afresh)."""
    me = ray.get_runtime_context().get_node_id()
    g = WorkerGroup(JobConfig(), str(tmp_path), cpus_per_worker=1, gpus_per_worker=0, job_id="t5")

    @ray.remote(num_cpus=0)
    def dies_after(_claimed):  # Ray runs it once the claim it is given has answered: a fixed order
        raise RuntimeError("this worker's start failed")

    try:
        g.scale_to([me])
        g.keep_standby()
        standby = _settled_standby(g)
        g.stop_members()
        (claimed,) = g.standby
        monkeypatch.setattr(g.launcher, "launch", lambda nodes: [
            WorkerHandle(None, n, None, Role.SPARE, ping=dies_after.remote(claimed.ping)) for n in nodes])
        with pytest.raises(WorkerFailure, match="this worker's start failed"):
            g.scale_to([me, me])  # claims the standby, launches one more: that one fails
        assert g.size == 0 and not g.standby and g.spares == [claimed]
        g.stop_members()
        assert g.spares == [claimed]  # sound, and its node is not dead
        monkeypatch.undo()
        start = g.scale_to([me])
        assert (start.started, start.from_standby) == (1, 0)
        assert ray.get(g.members[0].actor.info.remote(), timeout=30).pid == standby.pid
    finally:
        g.shutdown()
    _cpus_free(2.0)


def test_a_standby_still_starting_when_its_group_is_taken_over_is_kept_not_started_again(local_ray, tmp_path):
    """A coordinator that takes a job's workers over (`adopt`) does not wait for a standby still starting
    (its `info` answers once its process has imported torch), but keeps it on the node its name gives
    instead of stopping it: each coordinator kill used to replace every standby, and the new processes'
    start slowed the next steps (seen in chaos, kill_coordinator only: all 3 killed and started again
    at every takeover)."""
    from service.pool.detached import standby_node

    @ray.remote(num_cpus=0)
    class Owner:  # stands for the job's coordinator actor, which detached workers watch by name
        def ping(self) -> bool:
            return True

    me = ray.get_runtime_context().get_node_id()
    owner = Owner.options(name="owner-t6", namespace="elastron").remote()
    ray.get(owner.ping.remote(), timeout=30)
    args = dict(cpus_per_worker=1, gpus_per_worker=0, job_id="t6", owner="owner-t6")
    g = WorkerGroup(JobConfig(), str(tmp_path), **args)
    h = None
    try:
        g.scale_to([me])
        assert g.keep_standby() == 1
        (starting,) = g.standby
        h = WorkerGroup(JobConfig(), str(tmp_path), **args)  # the next coordinator's group
        assert h.adopt() == 1
        (kept,) = h.standby
        assert kept.ping not in ray.wait([kept.ping], timeout=0)[0]  # taken over before it answered
        assert kept.node_id == me and kept.actor._actor_id == starting.actor._actor_id
        assert ray.get(kept.ping, timeout=60).pg is None  # it came up as a standby
        assert h.keep_standby() == 0 and len(h.standby) == 1  # nothing started in its place
        names = [e["name"] for e in ray.util.list_named_actors(all_namespaces=True)
                 if e["name"].startswith("elastron-worker-t6-")]
        assert sorted(standby_node("t6", n) or "member" for n in names) == sorted([me, "member"])
    finally:
        (h or g).shutdown()
        ray.kill(owner)
    _cpus_free(2.0)
