"""A restarted coordinator taking over the workers its previous process left running.

A group with an owner starts its workers detached and named after the job, so they outlive the
coordinator's process; Ray restarts that coordinator, whose new group finds them by name (`adopt`) and
asks the members where they stand (`carry_on`): if they are still one sound training group, it trains on
with them as they are; if not, the salvage that follows deals with them.
"""

from __future__ import annotations

import ray
from ray.exceptions import RayError

from parallel.planner import Plan
from service.pool.calls import Calls, replies
from service.pool.detached import find_workers, release_workers, standby_node
from service.pool.group import CarriedOn
from service.pool.launch import CONTROL, Launcher
from service.pool.roster import Role, Roster, WorkerHandle

__all__ = ["Takeover"]


class Takeover:
    """Takes over the detached workers of job `job_id` (`owner`: the named actor its coordinator runs in,
    None for a group whose workers end with their process) into `roster`."""

    def __init__(self, *, roster: Roster, calls: Calls, launcher: Launcher, job_id: str, owner: str | None,
                 namespace: str):
        self.roster, self.calls, self.launcher = roster, calls, launcher
        self.job_id, self.owner, self.namespace = job_id, owner, namespace

    def adopt(self, *, timeout_s: float = 10.0) -> int:
        """Take over the detached workers a previous coordinator of this job left running (its process
        died; they did not): each that answers within `timeout_s` becomes a member, the others are
        stopped. Standbys stay standbys; one still starting is not waited for (its `info` waits for its
        start, ~2 s) but kept on the node its name gives, its answer read later as its ping
        (`Reserve.keep_standby` replaces it then if it turns out claimed or dead; a claimed one answers
        as soon as the members do). Their process groups and trainers are as that coordinator left them.
        The placement groups of workers that died meanwhile are removed. Returns how many were taken
        over (0 for a group without an owner)."""
        if self.owner is None:
            return 0
        found = find_workers(self.job_id, self.namespace)
        refs = [a.info.options(concurrency_group=CONTROL).remote() for _, a in found]
        pinned = {r: standby_node(self.job_id, name) for (name, _), r in zip(found, refs)}
        standby = {r for r, node in pinned.items() if node is not None}
        ready = replies([r for r in refs if r not in standby], timeout_s=timeout_s, grace_s=timeout_s)
        ready |= set(ray.wait(list(standby), num_returns=len(standby), timeout=0.1)[0])
        for (_, actor), ref in zip(found, refs):
            info = None
            if ref in ready:
                try:
                    info = ray.get(ref)
                except RayError:
                    pass
            if ref in standby and ref not in ready:  # still starting: kept, its answer read as its ping
                self.roster.add([WorkerHandle(actor, pinned[ref], None, Role.STANDBY, ping=ref)])
            elif info is None:
                self.launcher.kill(actor)
            elif info.pg is None:  # a standby, never claimed: it stays one
                self.roster.add([WorkerHandle(actor, info.node_id, None, Role.STANDBY, ping=ref)])
            else:
                self.roster.add([WorkerHandle(actor, info.node_id, info.pg, Role.MEMBER, ip=info.ip)])
        self.calls.stop_waiting([r for r in refs if r not in ready and r not in standby])
        release_workers(self.job_id, keep={m.pg.id.hex() for m in self.roster.members})
        self.roster.set_members(self.roster.members)  # members first
        return len(self.roster.members)

    def carry_on(self, plan: Plan, *, timeout_s: float = 15.0, grace_s: float = 1.0) -> CarriedOn:
        """After `adopt`: ask every member where it stands (`Worker.standing`, answered once the call the
        lost coordinator sent has ended); if they are `plan`'s ranks, each sound, at one step, they
        are the group, in rank order. A member stuck in a collective (that coordinator died between
        sending a call to one member and to the next) does not answer: `grace_s` after the first
        answer, the group does not carry on, and the salvage that follows deals with it."""
        members = list(self.roster.members)
        refs = [m.actor.standing.remote() for m in members]
        ready = replies(refs, timeout_s=timeout_s, grace_s=grace_s)
        self.calls.stop_waiting([r for r in refs if r not in ready])
        if len(ready) < len(refs):
            return CarriedOn(why=f"{len(refs) - len(ready)} of {len(refs)} workers did not answer")
        try:
            said = [ray.get(r) for r in refs]
        except RayError as e:
            return CarriedOn(why=f"a worker failed to answer: {type(e).__name__}")
        if unsound := [s.why for s in said if not s.sound]:
            return CarriedOn(why=f"{len(unsound)} worker(s) cannot carry on ({unsound[0]})")
        if sorted(s.rank for s in said) != list(range(plan.world_size)):
            return CarriedOn(why=f"ranks {sorted(s.rank for s in said)} are not the {plan.world_size} of {plan.layout}")
        theirs = {(s.plan.layout, s.plan.micro_batch_size, s.plan.grad_accum_steps) for s in said}
        if theirs != {(plan.layout, plan.micro_batch_size, plan.grad_accum_steps)}:
            return CarriedOn(why=f"they train another plan than {plan.layout}")
        if len(steps := {s.step for s in said}) != 1:
            return CarriedOn(why=f"they are at different steps {sorted(steps)}")
        by_rank = sorted(zip(said, members), key=lambda p: p[0].rank)
        self.roster.set_members([m for _, m in by_rank])
        head = by_rank[0][0]
        return CarriedOn(step=head.step, committed_step=head.committed_step, rows=head.rows)
