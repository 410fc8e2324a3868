"""The faults a chaos run injects, and the seeded schedule that orders them.

Each fault acts like the real thing, from outside the job: a SIGKILL, a node's raylet killed, a GCS
drain request with a deadline (then the node killed at the deadline, as a cloud provider would), the
API process killed. None of them tells the job anything. Each returns a short description of what it
did; `expect` says which event the job's log must show for it ("failure", "preemption", or None when
the job should not notice at all).
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from benchmarks.chaos_env import ChaosEnv, wait

KINDS = ("kill_worker", "remove_node", "drain_short", "drain_long", "kill_during_checkpoint",
         "kill_coordinator", "restart_api", "double")


@dataclass
class Ctx:
    env: ChaosEnv
    rng: random.Random
    job: Callable[[], dict]
    """The job as the API shows it now."""
    ckpt_dir: Path
    strikes: list[float] = field(default_factory=list)
    """When each of the fault's acts (a kill, a drain notice) happened; the injection's time also counts
    choosing a victim (asking the job's workers where they run: up to 0.5 s)."""

    def strike(self) -> None:
        self.strikes.append(time.time())


def kill_worker(ctx: Ctx) -> str:
    pids = wait(ctx.env.worker_pids, 60, "a training worker process")
    pid = ctx.rng.choice(sorted(pids))
    ctx.strike()
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL worker pid {pid}"


def _victim(ctx: Ctx):
    nodes = wait(ctx.env.nodes_with_workers, 60, "a node hosting workers")
    return ctx.rng.choice(sorted(nodes, key=lambda n: n.node_id))


def remove_node(ctx: Ctx) -> str:
    node = _victim(ctx)
    ctx.strike()
    ctx.env.remove_node(node)
    return f"removed node {node.node_id[:8]} without notice"


def _drain(ctx: Ctx, deadline_s: float, *, leave_first: bool) -> str:
    from service.pool.cluster import drain_node

    node = _victim(ctx)
    t0 = time.monotonic()
    ctx.strike()
    drain_node(node.node_id, message="chaos: spot reclaim", deadline_remaining_s=deadline_s)
    left = False
    if leave_first:  # a long notice: the job should move off the node before the deadline
        try:
            left = bool(wait(lambda: not ctx.env.workers_on(node), deadline_s, "the job to leave the node"))
        except TimeoutError:
            left = False
    time.sleep(max(0.0, deadline_s - (time.monotonic() - t0)) if not left else 0.0)
    ctx.env.remove_node(node)  # the provider takes the node at the deadline (or once it is idle)
    after = "after the job left it" if left else "at the deadline"
    return f"drained node {node.node_id[:8]} with a {deadline_s:g} s deadline, removed {after}"


def drain_short(ctx: Ctx) -> str:
    return _drain(ctx, 0.05, leave_first=False)  # shorter than any checkpoint save


def drain_long(ctx: Ctx) -> str:
    return _drain(ctx, 60.0, leave_first=True)


def kill_during_checkpoint(ctx: Ctx) -> str:
    """Watch the checkpoint directory for a save in progress (its staging directory) and SIGKILL a
    worker while it is there."""
    def writing():
        try:
            return [e.name for e in os.scandir(ctx.ckpt_dir) if e.name.startswith(".step-") and e.name.endswith(".tmp")]
        except FileNotFoundError:
            return []
    staging = wait(writing, 120, "a checkpoint save in progress", interval=0.002)[0]
    pid = ctx.rng.choice(sorted(ctx.env.worker_pids()))
    ctx.strike()
    os.kill(pid, signal.SIGKILL)
    final = staging[1:-len(".tmp")]
    committed = (ctx.ckpt_dir / final).exists()
    return (f"SIGKILL worker pid {pid} while {staging} was being written"
            f"{' (its commit had just landed)' if committed else ''}")


def kill_coordinator(ctx: Ctx) -> str:
    pid = ctx.job()["pid"]
    ctx.strike()
    os.kill(pid, signal.SIGKILL)
    return f"SIGKILL coordinator actor pid {pid}"


def restart_api(ctx: Ctx) -> str:
    took = ctx.env.restart_api()
    return f"API server killed and started again ({took:.1f} s until it answered)"


def double(ctx: Ctx) -> str:
    first = kill_worker(ctx)
    time.sleep(0.3)
    return f"{first}; 0.3 s later: {remove_node(ctx)}"


FAULTS: dict[str, tuple[Callable[[Ctx], str], str | None]] = {
    "kill_worker": (kill_worker, "failure"),
    "remove_node": (remove_node, "failure"),
    "drain_short": (drain_short, "failure|preemption"),
    "drain_long": (drain_long, "preemption"),
    "kill_during_checkpoint": (kill_during_checkpoint, "failure"),
    "kill_coordinator": (kill_coordinator, "failure"),
    "restart_api": (restart_api, None),
    "double": (double, "failure"),
}


def schedule(n: int, seed: int, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """`n` fault kinds: every one of `kinds` once per round, each round in a seeded order."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        rnd = list(kinds)
        rng.shuffle(rnd)
        out += rnd
    return out[:n]
