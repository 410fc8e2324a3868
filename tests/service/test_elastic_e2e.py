"""Tier 3: the four elastic flows on a real Ray cluster (`ray.cluster_utils.Cluster`) while the tiny model
trains. Every test compares every step's loss with one uninterrupted single-process run (1e-4 relative)
and asserts the steps redone or lost. Waits are on conditions with deadlines, never on sleeps.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from service.control.job import Job
from service.control.coordinator import Coordinator, CoordinatorOptions
from tests.bodies import train_body
from tests.multiproc import run_ranks
from service.control.commands import SetWorkers
from workers.config import JobConfig
from workers.reshard import SEND_RECV_PARTS

pytestmark = pytest.mark.e2e

STEPS = 14
LONG = 40  # the grow test needs time for a node to register and settle
INTERVAL = 4
CFG = {
    "model": {"preset": "tiny"},
    "data": {"source": "corpus", "seq_len": 32, "max_bytes": 300_000},
    "train": {"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 2,
              "seed": 7},
    "parallel": {"min_workers": 1, "max_workers": 4},
    "checkpoint": {"interval_steps": INTERVAL, "keep_last": 3},
    "resources": {"device": "cpu", "cpus_per_worker": 1},
}


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """Uninterrupted single-process losses; long enough for the longest test (the LR horizon stays
    train.steps, so a run told to go further simply continues at the final LR)."""
    (res,) = run_ranks(1, train_body, CFG, "dp=1", LONG, return_params=False)
    return res["losses"]


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture
def nodes(cluster):
    """Adds 1-CPU nodes on request; removes whatever is left at the end of the test."""
    added = []

    def add(n=1):
        new = [cluster.add_node(num_cpus=1) for _ in range(n)]
        added.extend(new)
        cluster.wait_for_nodes()
        return new

    yield add
    for n in added:
        try:
            cluster.remove_node(n, allow_graceful=False)
        except Exception:  # already removed by the test, or exited after a drain
            pass


class Hold:
    """Keeps the coordinator's loop from training past `at_step` (once `armed`) until the test says go
    (`release()`), then, while `slow_until` is false, lets it train only one chunk per `pace_s`.

    Tiny-model steps take tens of milliseconds; adding a Ray node takes seconds. Without a hold the job
    can finish before the cluster change it is meant to see (CI saw exactly that). The hold only delays
    the loop between chunks; what the coordinator decides and what the workers compute are unchanged.
    A job started with a hold trains one step per chunk (`start`): a chunk sized to the coordinator's
    0.2 s could otherwise carry the job from before `at_step` to its last step (a full-suite run saw a
    chunk go from step 9 or below to 14 and the job succeed before the node it was to lose was gone).
    """

    def __init__(self, at_step: int, *, pace_s: float = 0.0, slow_until=lambda coord: True,
                 armed=lambda coord: True):
        self.at_step, self.pace_s, self.slow_until, self.armed = at_step, pace_s, slow_until, armed
        self._go = threading.Event()

    def release(self) -> None:
        self._go.set()

    def __call__(self, coord: Coordinator) -> None:  # Coordinator.run(on_tick=...)
        if coord.step_done < self.at_step or not self.armed(coord):
            return
        if not self._go.wait(timeout=240):
            raise TimeoutError(f"the test never released the hold at step {self.at_step}")
        if not self.slow_until(coord):
            time.sleep(self.pace_s)


def start(tmp_path, *, settle=1000.0, steps=STEPS, hold: Hold | None = None,
          **cfg_over) -> tuple[Coordinator, threading.Thread]:
    d = {**CFG, **cfg_over}
    chunk_s = 1e-6 if hold is not None else 0.2  # 1e-6: one step per chunk (see Hold)
    coord = Coordinator(Job.of(JobConfig.from_dict(d), job_id="e2e", run_dir=tmp_path, steps=steps),
                        options=CoordinatorOptions(settle_seconds=settle, chunk_seconds=chunk_s, poll_interval_s=0.2))
    t = threading.Thread(target=coord.run, kwargs={"on_tick": hold}, daemon=True)
    t.start()
    return coord, t


def wait_for(coord: Coordinator, cond, what: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert not coord.state.name.is_terminal or cond(), f"job ended ({coord.state.name}: {coord.state.reason}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}; state {coord.state.name} {coord.state.reason}"
        time.sleep(0.05)


def finish(coord: Coordinator, t: threading.Thread, reference: list[float]):
    t.join(timeout=300)
    assert str(coord.state.name) == "SUCCEEDED", coord.state.reason
    losses = [m["loss"] for m in coord.metrics_since(0)]
    assert len(losses) == coord.total_steps
    for step, (got, want) in enumerate(zip(losses, reference[:coord.total_steps]), start=1):
        assert abs(got - want) <= 1e-4 * abs(want), f"step {step}: loss {got} vs uninterrupted {want}"
    changes = coord.reconfigs[1:]
    assert coord.reconfigs[0].cause == "planned" and changes
    return changes


def timeline(coord: Coordinator) -> str:
    """The job's events, one a line, for an assertion's message."""
    return "\n".join(f"{e['time']:.2f} {e['kind']} {e.get('to_state')}: {e['reason']}" for e in coord.events_since(0))


def not_driver(node_ids):
    """Node ids other than the one this driver is attached to (all simulated nodes share one IP, so it
    may be any of them; removing or draining it would take the driver down)."""
    import ray

    me = ray.get_runtime_context().get_node_id()
    return sorted(n for n in node_ids if n != me)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as gone)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def running_at(coord, step):
    return lambda: coord.step_done >= step and str(coord.state.name) == "RUNNING"


def test_planned_resize_redoes_no_steps(cluster, nodes, reference, tmp_path):
    nodes(2)
    hold = Hold(4)  # a chunk of steps could otherwise reach the last step before the request is queued
    coord, t = start(tmp_path, hold=hold)
    wait_for(coord, running_at(coord, 4), "step 4")
    coord.send(SetWorkers(workers=1))
    hold.release()
    (rc,) = finish(coord, t, reference)
    assert rc.cause == "user" and rc.steps_lost == 0 and rc.resumed_step == rc.step_before
    assert rc.old_layout.dp_replicate * rc.old_layout.dp_shard == 2 and rc.world_size == 1
    assert rc.started == 0 and rc.stopped == 1  # the surviving actor was reused
    assert rc.transfer.path == "live"  # no storage: the survivor held a whole replica, 0 bytes to move
    assert set(rc.transfer.moved.transfer_parts.names()) == {
        "rendezvous", "rendezvous.rendezvous_s", "rendezvous.connect_s", "agree", "plan", "state", "send_recv", "leave",
        "cpu_s", *(f"send_recv.{p}" for p in SEND_RECV_PARTS)}


def test_preemption_notice_trains_on_then_moves_live_before_the_deadline_and_loses_nothing(cluster, nodes, reference,
                                                                                           tmp_path):
    from service.pool.cluster import drain_node

    nodes(3)
    # Hold at step 5 while the drain is requested, then train slowly until the job has moved off the node:
    # with a 5 s deadline and a 2 s lead (the floor: no move measured yet, and the assumed one is 0 s here)
    # the group trains on with the noticed node for about 3 s, and the job must not finish before that.
    hold = Hold(5, pace_s=0.3, slow_until=lambda c: len(c.reconfigs) >= 2)
    coord, t = start(tmp_path, steps=LONG, hold=hold,
                     parallel={**CFG["parallel"], "drain_floor_s": 2.0, "drain_move_s": 0.0})
    wait_for(coord, running_at(coord, 5), "step 5")
    victim = not_driver(coord.group.nodes())[0]
    drain_node(victim, message="test: spot reclaim", deadline_remaining_s=5)
    hold.release()
    (rc,) = finish(coord, t, reference)
    assert rc.cause == "preemption" and rc.steps_lost == 0, timeline(coord)
    assert rc.world_size == 2 and rc.started == 0
    assert rc.transfer.path == "live"  # the draining node's workers sent their shards before leaving
    events = coord.events_since(0)
    (held,) = [e for e in events if e["kind"] == "capacity" and e["reason"].startswith("training on")]
    deadline = held["details"]["draining"][victim]
    assert held["details"]["move_at"] == pytest.approx(deadline - 2.0, abs=0.01)
    assert deadline - 2.0 - 0.01 <= rc.detected < deadline, timeline(coord)  # at the lead, not at the notice
    assert rc.step_before >= held["step"] + 3, timeline(coord)  # it trained on with the node meanwhile
    kinds = [e["kind"] for e in events]
    assert "preemption" in kinds and "checkpoint" in kinds


def test_failure_without_notice_resumes_from_last_commit_and_waits_for_capacity(cluster, nodes, reference, tmp_path):
    added = nodes(2)
    # The node goes at step 9 (after the kill's recovery): keep the job from finishing before it does.
    hold = Hold(9, armed=lambda c: len(c.reconfigs) >= 2)
    coord, t = start(tmp_path, parallel={"min_workers": 2, "max_workers": 2}, hold=hold)
    wait_for(coord, running_at(coord, 3), "step 3")
    # 1) SIGKILL one worker process: same capacity, restart from the last committed checkpoint.
    import ray

    pid = ray.get(coord.group.members[1].actor.info.remote()).pid
    os.kill(pid, signal.SIGKILL)
    wait_for(coord, lambda: len(coord.reconfigs) >= 2, "recovery from the worker kill")
    # 2) Remove a node: below min_workers, so the job waits with the reason visible, then resumes.
    wait_for(coord, running_at(coord, 9), "step 9")
    victim = next(n for n in added if n.node_id in not_driver(coord.group.nodes()))
    doomed = [ray.get(m.actor.info.remote()).pid for m in coord.group.members if m.node_id == victim.node_id]
    cluster.remove_node(victim, allow_graceful=False)
    # A worker outlives its killed raylet by a moment and could still finish the last steps: release
    # the hold once the node's workers are gone, as they would be on a machine that vanished.
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in doomed):
        assert time.monotonic() < deadline, f"workers {doomed} still alive 60 s after their node was removed"
        time.sleep(0.05)
    hold.release()
    wait_for(coord, lambda: str(coord.state.name) == "WAITING_FOR_CAPACITY", "WAITING_FOR_CAPACITY")
    assert "min_workers=2" in coord.status().reason
    nodes(1)
    kill, node = finish(coord, t, reference)
    assert kill.cause == node.cause == "failure"
    # The kill: the surviving replica holds every shard, so the group heals from it (no step redone);
    # only the killed rank is a fresh process.
    assert kill.transfer.path == "peers" and kill.steps_lost == 0 and kill.started == 1
    # The node loss: below min_workers, the survivor is released; back from the last commit (periodic,
    # or the durable one written after the heal's first step).
    assert 0 <= node.steps_lost <= INTERVAL and node.steps_lost == node.step_before - node.resumed_step
    assert node.resumed_step >= kill.resumed_step and node.transfer.path == "storage"
    assert kill.world_size == 2 and node.world_size == 2


def test_grow_after_settle_redoes_no_steps(cluster, nodes, reference, tmp_path):
    nodes(1)
    # Hold at step 3 while the node registers, then train slowly until the grow has happened, so that
    # the 1 s settle plus the new worker's start and warm-up (the group trains on meanwhile) always fit
    # before the last step, on a loaded box too (~37 paced steps: over 30 s).
    hold = Hold(3, pace_s=1.0, slow_until=lambda c: len(c.reconfigs) >= 2)
    coord, t = start(tmp_path, settle=1.0, steps=LONG, hold=hold)
    wait_for(coord, running_at(coord, 3), "step 3")
    nodes(1)
    hold.release()
    (rc,) = finish(coord, t, reference)
    assert rc.cause == "grow" and rc.steps_lost == 0 and rc.world_size == 2
    assert rc.started == 1 and rc.stopped == 0
    assert rc.transfer.path == "live" and rc.transfer.moved.bytes_moved > 0  # the joiner got its state from the survivor


def test_a_killed_fsdp_shard_is_served_from_its_buddys_memory(cluster, nodes, reference, tmp_path):
    """FSDP shards (no replica to heal from): each rank's snapshot lives in its buddy's memory on the other
    node, so a worker killed without notice costs at most the step since the last snapshot, and the
    checkpoint directory is never read (there is no commit to read before the job ends)."""
    import ray

    nodes(2)
    hold = Hold(4)
    coord, t = start(tmp_path, steps=8, hold=hold, parallel={"min_workers": 2, "max_workers": 2, "dp_mode": "shard"},
                     checkpoint={"interval_steps": 1000, "keep_last": 3, "peer_interval": 1, "peer_budget": 0})
    wait_for(coord, running_at(coord, 4), "step 4")
    pid = ray.get(coord.group.members[1].actor.info.remote()).pid
    os.kill(pid, signal.SIGKILL)
    hold.release()
    (kill,) = finish(coord, t, reference)
    kinds = [e["kind"] for e in coord.events_since(0)]
    assert kill.cause == "failure" and kill.transfer.path == "memory", timeline(coord)
    assert "fallback" not in kinds, timeline(coord)
    assert kill.steps_lost <= 1 and kill.resumed_step == kill.transfer.snapshot_step, timeline(coord)
    assert kill.world_size == 2 and kill.started == 1
    # peer_budget 0: a snapshot after every step, whatever it costs (workers.pace)
    paced = {m["step"]: m["snapshot"]["interval"] for m in coord.metrics_since(0) if m.get("snapshot")}
    assert all(paced.get(s) == 1 for s in range(1, 4)), paced


def test_a_killed_pipeline_stage_is_served_from_its_buddys_memory_with_its_optimizer_state(cluster, nodes, reference,
                                                                                          tmp_path):
    """Under pipeline parallelism each stage holds parameters no other rank has: the lost stage's
    shards and its AdamW step counters come from its buddy's copy. (The counters once came only from each
    worker's own stage: the new stage restarted AdamW from zero, and the loss two steps after the kill
    was 1.6% off.)"""
    import ray

    nodes(3)
    hold = Hold(4)
    coord, t = start(tmp_path, steps=8, hold=hold, parallel={"min_workers": 2, "max_workers": 3, "pp": 3},
                     checkpoint={"interval_steps": 1000, "keep_last": 3, "peer_interval": 1, "peer_budget": 0})
    wait_for(coord, running_at(coord, 4), "step 4")
    pid = ray.get(coord.group.members[1].actor.info.remote()).pid
    os.kill(pid, signal.SIGKILL)
    hold.release()
    (kill,) = finish(coord, t, reference)  # losses of every step, the two after the kill included
    assert kill.cause == "failure" and kill.transfer.path == "memory", timeline(coord)
    assert kill.steps_lost <= 1 and kill.resumed_step == kill.transfer.snapshot_step, timeline(coord)
