"""WorkerGroup on a local Ray: a start that fails releases what it reserved (the chaos run found a
failed start leaking its placement groups, so that the next start could not place anything); the other
ranks' errors after a failed step are read, not left for Ray to print as unhandled."""

from __future__ import annotations

import logging
import time

import pytest

from service.control.failure import fate
from service.pool.calls import replies
from service.pool.group import WorkerFailure
from service.pool.worker_group import Role, WorkerGroup, WorkerHandle
from tests.ray_local import local_ray  # noqa: F401  (a fixture)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.e2e


def test_a_failed_start_releases_its_placement_groups_and_cpus(local_ray, tmp_path):
    from ray.util import placement_group_table

    me = ray.get_runtime_context().get_node_id()
    # The worker's constructor rejects this config (a dict, not a JobConfig), so both actors die while starting.
    g = WorkerGroup({"model": {"preset": "no-such-preset"}}, str(tmp_path), cpus_per_worker=1, gpus_per_worker=0,
                    job_id="t", start_timeout_s=60)
    with pytest.raises(WorkerFailure, match="during start"):
        g.scale_to([me, me])
    assert g.size == 0
    states = [pg["state"] for pg in placement_group_table().values()]
    assert states and all(s == "REMOVED" for s in states), states
    deadline = time.monotonic() + 10  # resource release is asynchronous
    while ray.available_resources().get("CPU") != 2.0:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


def test_the_probe_finds_a_node_alive_while_all_its_cpus_are_reserved(local_ray):
    """Right after a failure the node's CPUs may still be held by placement groups being removed; the
    probe must not take that for a dead raylet."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from service.pool.placement import probe_nodes

    me = ray.get_runtime_context().get_node_id()
    full = placement_group([{"CPU": 2}], strategy="STRICT_PACK")
    ray.get(full.ready(), timeout=30)
    try:
        assert probe_nodes([me], timeout_s=5) == {me}
    finally:
        remove_placement_group(full)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_other_ranks_errors_after_a_failed_step_are_read_not_reported_as_unhandled(local_ray, tmp_path):
    """The demo's kill printed Ray's "Unhandled error" traceback of a surviving rank's `run` (its gloo
    peer had gone): the group stopped waiting at the first failure and dropped the other refs unread."""
    from workers.config import JobConfig

    @ray.remote(num_cpus=0)
    class FailingRank:  # stands in for workers.actor.Worker: a step that raises after `after` seconds
        def __init__(self, after: float, tag: str) -> None:
            self.after, self.tag = after, tag

        def run(self, *, until_step: int, steps: int) -> list:
            time.sleep(self.after)
            raise RuntimeError(f"{self.tag} lost its peer")

        def ping(self) -> bool:
            return True

    ray_log, ours = _Collect(), _Collect()
    logging.getLogger("ray._private.worker").addHandler(ray_log)
    group_log = logging.getLogger("service.pool.calls")
    group_log.addHandler(ours)
    level, group_log.level = group_log.level, logging.DEBUG
    try:
        first, second = FailingRank.remote(0.0, "rank-0-6f1e"), FailingRank.remote(0.5, "rank-1-6f1e")
        g = WorkerGroup(JobConfig(), str(tmp_path), cpus_per_worker=0, gpus_per_worker=0, job_id="t")
        g.workers = [WorkerHandle(first, "n", None, Role.MEMBER), WorkerHandle(second, "n", None, Role.MEMBER)]
        with pytest.raises(WorkerFailure, match="rank-0-6f1e"):
            g.run(until_step=1, steps=1)
        assert ray.get(second.ping.remote(), timeout=30)  # rank 1's run has ended: one call at a time
        g.shutdown()
        assert any("rank-1-6f1e" in m for m in ours.messages), ours.messages
        # Control: Ray does report a failed call that nobody reads once its ref is dropped; once it has,
        # rank 1's ref (dropped with the group, before it) would have been reported too.
        control = FailingRank.remote(0.0, "control-6f1e")
        ref = control.run.remote(until_step=1, steps=1)
        assert ray.get(control.ping.remote(), timeout=30)
        del ref, g
        deadline = time.monotonic() + 30
        while not any("control-6f1e" in m for m in ray_log.messages):
            assert time.monotonic() < deadline, "Ray never reported the unread control error"
            time.sleep(0.1)
        assert not [m for m in ray_log.messages if "6f1e" in m and "control" not in m], ray_log.messages
    finally:
        logging.getLogger("ray._private.worker").removeHandler(ray_log)
        group_log.removeHandler(ours)
        group_log.level = level


def test_the_salvage_wait_stops_for_members_a_probe_found_dead(local_ray):
    """After a node failure the salvage waits at most its grace (2 s) for members that do not answer;
    members on a node the probe beside it found dead (`skip`) are not waited for at all."""

    @ray.remote(num_cpus=0)
    def answer(delay: float) -> float:
        time.sleep(delay)
        return delay

    quick, silent = answer.remote(0.0), answer.remote(60.0)
    found: set = set()
    t0 = time.monotonic()
    ready = replies([quick, silent], timeout_s=60, grace_s=1, skip=lambda: found)
    assert ready == {quick} and time.monotonic() - t0 >= 1  # the grace was waited out: nothing said it was dead
    found.add(silent)
    t0 = time.monotonic()
    ready = replies([answer.remote(0.0), silent], timeout_s=60, grace_s=30, skip=lambda: found)
    assert len(ready) == 1 and silent not in ready and time.monotonic() - t0 < 30  # not its grace


def _plan_for_two(cfg):
    """The planner's layout for two workers of `cfg`."""
    from dataclasses import replace

    from parallel.planner import plan
    from workers.config import job_constraints

    return plan(2, cfg.model.build(), replace(job_constraints(cfg), min_workers=1, max_workers=2))


def test_a_member_left_alone_in_a_step_is_freed_by_its_peers_salvage_and_kept(local_ray, tmp_path):
    """A coordinator killed between sending a step to one member and to its peer leaves the first
    waiting in the step's collective for a peer that never joins. The peer's salvage (after a takeover:
    no abort) destroys its process group and collects it at once (`workers.actor.release_dropped`), which
    closes its gloo sockets: the waiting member's step fails before its weight update, so it answers the
    salvage too and both are kept at the last finished step, no process stopped. (Before the collection
    the sockets stayed open while the peer kept its model, and the member had to be stopped.)"""
    from ray.exceptions import RayError

    from workers.config import JobConfig

    cfg = JobConfig()
    me = ray.get_runtime_context().get_node_id()
    g = WorkerGroup(cfg, str(tmp_path), cpus_per_worker=1, gpus_per_worker=0, job_id="t", start_timeout_s=60)
    try:
        g.scale_to([me, me])
        g.form(_plan_for_two(cfg))
        assert [r.step for r in g.run(until_step=2, steps=2).rows] == [1, 2]
        alone = g.members[0].actor.run.remote(until_step=3, steps=1)  # its peer never gets this call
        salvage = g.salvage(fate=fate, abort=False, timeout_s=30)
        infos = salvage.kept
        assert sorted(infos) == [0, 1] and {i.step for i in infos.values()} == {2}, infos
        assert salvage.stopped_why == () and g.size == 2
        with pytest.raises(RayError):  # the step it was left alone in failed when its peer's group closed
            ray.get(alone, timeout=30)
    finally:
        g.shutdown()


def test_members_with_no_state_to_salvage_are_kept_as_spares_and_the_next_start_takes_them(local_ray, tmp_path):
    """A second failure soon after a first (the chaos run's double faults): the first one's survivors are
    warm processes that dropped their trainers, and answer the next salvage with no state. They are sound
    and hold their slots, so they wait as spares and the re-form takes them instead of starting new
    processes (they used to be stopped, and each replaced by a ~2.5 s process start)."""
    from workers.config import JobConfig

    cfg = JobConfig()
    me = ray.get_runtime_context().get_node_id()
    g = WorkerGroup(cfg, str(tmp_path), cpus_per_worker=1, gpus_per_worker=0, job_id="t", start_timeout_s=60)
    p = _plan_for_two(cfg)
    try:
        g.scale_to([me, me])
        pids = sorted(i.pid for i in ray.get([m.actor.info.remote() for m in g.members], timeout=30))
        # each worker process started with glibc's arena cap (read at process start: its initial environment)
        env = ray.get([m.actor.__ray_call__.remote(_initial_env) for m in g.members], timeout=30)
        assert env == [{"MALLOC_ARENA_MAX": "2"}] * 2, env
        g.form(p)
        g.run(until_step=1, steps=1)
        assert sorted(g.salvage(fate=fate).kept) == [0, 1]  # the first failure: both vouch for their state, and drop it
        salvage = g.salvage(fate=fate)
        assert salvage.kept == {} and salvage.stopped_why == () and salvage.idle == 2  # the second: none left
        assert g.size == 0 and len(g.spares) == 2
        start = g.scale_to([me, me])
        assert (start.started, start.stopped, start.rejoined) == (0, 0, 2)  # members again, from the spares: no process started
        assert sorted(i.pid for i in ray.get([m.actor.info.remote() for m in g.members], timeout=30)) == pids
        formed = g.form(p)
        assert g.spares == [] and formed.step == 0  # no checkpoint was written: from the start again
        assert {"pg_s", "pg.rendezvous_s", "pg.connect_s", "build_s", "adopt_s", "build.allocate"} <= set(formed.form_parts.names())  # where a form goes
        assert [r.step for r in g.run(until_step=1, steps=1).rows] == [1]
    finally:
        g.shutdown()


def test_a_member_waiting_in_a_rendezvous_for_a_dead_peer_is_called_off_and_kept_as_a_spare(local_ray, tmp_path):
    """A second fault during a re-form (the chaos run's doubles): a member waits in the new group's
    rendezvous for a peer that died before joining. The salvage's abort calls that wait off, so the
    member answers with no state and is kept as a spare for the next start; it used to wait there until
    the salvage gave up on it and stopped it, and the next start began a new process in its place."""
    from workers.config import JobConfig

    cfg = JobConfig()
    me = ray.get_runtime_context().get_node_id()
    g = WorkerGroup(cfg, str(tmp_path), cpus_per_worker=1, gpus_per_worker=0, job_id="t", start_timeout_s=60)
    try:
        g.scale_to([me, me])
        head = g.members[0]
        port = ray.get(head.actor.open_store.remote(), timeout=30)
        waiting = head.actor.join.remote(rank=0, world_size=2, master_addr=head.ip, master_port=port,
                                         plan=_plan_for_two(cfg))  # rank 1 never comes
        time.sleep(1.0)  # in its rendezvous by now
        t0 = time.monotonic()
        salvage = g.salvage(fate=fate, timeout_s=30)
        assert salvage.stopped_why == () and salvage.idle == 2 and salvage.kept == {}
        assert time.monotonic() - t0 < 5  # called off within a slice, not waited out
        with pytest.raises(ray.exceptions.RayTaskError, match="called off"):
            ray.get(waiting, timeout=30)
        start = g.scale_to([me, me])
        assert (start.started, start.rejoined) == (0, 2)  # both back, no process started
        assert g.form(_plan_for_two(cfg)).step == 0 and [r.step for r in g.run(until_step=1, steps=1).rows] == [1]
    finally:
        g.shutdown()


def test_a_spare_counts_on_the_node_it_runs_on_not_the_one_it_was_aimed_at(local_ray):
    """A spare's placement group targets its node softly: aimed at a node that could not take it, it lands
    on another and holds that node's slot. A start on that node must take it; counted on its target, it
    was taken for neither, and the start waited for good for the slot it held (seen once in the 20-fault
    chaos run: a growth after a drain retried "could not place 1 of 3 worker(s) (on a36a2d8f: PENDING)"
    every 60 s for good, a worker of the job holding that node's only CPU)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from workers.config import JobConfig
    from workers.report import WorkerInfo

    me = ray.get_runtime_context().get_node_id()
    g = WorkerGroup(JobConfig(), "/tmp", cpus_per_worker=1, gpus_per_worker=0, job_id="t")

    @ray.remote(num_cpus=0)
    def slow():
        time.sleep(60)

    pg = placement_group([{"CPU": 1}])
    ray.get(pg.ready(), timeout=30)
    answered = WorkerHandle(None, "aimed-elsewhere", None, Role.SPARE, ping=ray.put(WorkerInfo(node_id=me, ip="", pid=0)))
    starting = WorkerHandle(None, "aimed-elsewhere-too", pg, Role.SPARE, ping=slow.remote())  # not answered yet
    g.workers = [answered, starting]
    try:
        assert g.reserve.take_spares([me, me]) == [answered, starting]  # from its answer; from where its group landed
        assert (answered.node_id, starting.node_id) == (me, me) and g.spares == []
    finally:
        ray.cancel(starting.ping, force=True)
        remove_placement_group(pg)


@pytest.mark.parametrize("node_dead", [True, False])
def test_a_rank_still_running_after_the_others_answered_is_probed(local_ray, monkeypatch, node_dead):
    """A rank whose node died after the chunk's last collective fails no peer, and Ray reports its call
    only once its health checks declare the node dead (a chaos drain_short waited 2 s for it). Once
    some ranks answered, the others' nodes are probed: dead, the step fails with their nodes, long
    before that rank's call would end; alive, the wait goes on until it does."""
    from types import SimpleNamespace

    import service.pool.calls as pool_calls
    from workers.config import JobConfig

    @ray.remote(num_cpus=0)
    def answer(after_s: float):
        time.sleep(after_s)
        return [{"step": 1}]

    calls = []

    def call(after_s: float):
        calls.append(answer.remote(after_s))
        return calls[-1]

    def rank(after_s: float):
        return SimpleNamespace(run=SimpleNamespace(remote=lambda **_: call(after_s)))

    slow_s = 30.0 if node_dead else 3.0
    g = WorkerGroup(JobConfig(), "/tmp", cpus_per_worker=1, gpus_per_worker=0, job_id="t", start_probe_s=1.0)
    g.workers = [WorkerHandle(rank(0.0), "a", None, Role.MEMBER), WorkerHandle(rank(slow_s), "b", None, Role.MEMBER)]
    asked = []
    monkeypatch.setattr(pool_calls, "probe_nodes", lambda nodes, timeout_s: asked.append(nodes) or
                        {n for n in nodes if not (node_dead and n == "b")})
    t0 = time.monotonic()
    try:
        if node_dead:
            with pytest.raises(WorkerFailure) as e:
                g.run(until_step=10, steps=1)
            assert e.value.kind == "node_lost" and e.value.nodes == {"b"}
            assert time.monotonic() - t0 < slow_s / 2  # at a probe, not when the rank's call ends
        else:
            assert g.run(until_step=10, steps=1) == [{"step": 1}]
            assert time.monotonic() - t0 >= slow_s
        assert asked and all(nodes == ["b"] for nodes in asked)  # only the rank that had not answered
    finally:
        for ref in calls:
            ray.cancel(ref, force=True)


def _initial_env(_worker) -> dict:
    """The glibc malloc variables a worker's process was started with."""
    with open("/proc/self/environ", "rb") as f:
        pairs = [e.decode().split("=", 1) for e in f.read().split(b"\0") if e.startswith(b"MALLOC_")]
    return dict(pairs)
