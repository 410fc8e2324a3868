"""A group's reserve: workers started ahead of need, which the next start takes instead of starting
processes.

A spare is started in a slot of its own (ahead of a growth, `prewarm`; or a member a salvage kept
idle); a standby runs idle on a node reserving nothing, and a start claims it with a slot
(`take_standby`). Both warm up (`Worker.warm_up`) while they wait. Where standbys run is one pure rule
(`standby_targets`): beside the members, to replace one that crashes, and on one node the job may use
but does not, enough to replace the whole node that hosts the most members (a node lost without
notice: its replacements are claimed there, where a restart would start processes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from service.pool.detached import standby_kind
from service.pool.launch import Launcher
from service.pool.roster import Role, Roster, WorkerHandle
from service.pool.slots import Slots

__all__ = ["Reserve", "standby_targets"]


def standby_targets(per_node: int, members: Mapping[str, int], free: Mapping[str, int],
                    spares: Collection[str] = (), cap: int | None = None) -> dict[str, int]:
    """{node: standbys to keep there}: `per_node` on each node hosting `members` ({node: members}), and,
    for the loss of a whole node, on the node the job may use (`free`: {node: worker slots}, its grant
    applied) that hosts no member and no spare (a growth's spare has its node to itself while it warms
    up), as many as the node with the most members hosts, at most its slots. That node is the roomiest,
    then the lowest id: the one `service.pool.placement.assign_nodes` fills first after such a loss. None
    anywhere when `per_node` is 0 (standbys off) or there is no member. `cap`: at most this many in all
    (what the owner's worker quota leaves after the members, `service.sharing.rounds.standby_caps`): the
    idle node's go first, then one at a time from the nodes with most standbys (highest id first); None:
    no cap."""
    hosts = {nid: per_node for nid, n in members.items() if n > 0}
    if per_node <= 0 or not hosts:
        return {}
    taken = set(hosts) | set(spares)
    idle = sorted((nid for nid, k in free.items() if k > 0 and nid not in taken),
                  key=lambda nid: (-free[nid], nid))
    if idle and (cap is None or cap > sum(hosts.values())):
        hosts[idle[0]] = min(free[idle[0]], max(members.values()),
                             *(() if cap is None else (cap - sum(hosts.values()),)))
    while cap is not None and sum(hosts.values()) > cap:
        top = max(hosts, key=lambda nid: (hosts[nid], nid))
        hosts[top] -= 1
    return {nid: k for nid, k in hosts.items() if k > 0}


class Reserve:
    """The spares and standbys of one group (`roster`), started by `launcher` in slots from `slots`."""

    def __init__(self, *, roster: Roster, slots: Slots, launcher: Launcher):
        self.roster, self.slots, self.launcher = roster, slots, launcher

    # -- standbys ------------------------------------------------------------------------------------
    def keep_standby(self, per_node: int, free: Mapping[str, int] | None = None, cap: int | None = None) -> int:
        """Keep idle workers started where `standby_targets` says: `per_node` on each node that hosts
        members (not on a node that only a growth's spare holds yet: the spare's start and warm-up, which
        the growth waits for, have the node to themselves; its standby follows once it is a member), and
        a node's worth on one node of `free` ({node: worker slots} the job may use) that hosts none;
        without waiting for them. A standby reserves nothing: it runs pinned to its node and holds a slot
        only once claimed as a member (`take_standby`). Each call reads the standbys' last ping (`info`)
        and sends the next: those that died (or whose node did) are dropped, as are those beyond what
        their node should keep (a node that hosts no member any more, or no longer the idle one). A new
        standby first warms up (`Worker.warm_up`). `cap`: at most this many standbys in all (None: no cap).
        Returns how many were started."""
        want = standby_targets(per_node, Counter(w.node_id for w in self.roster.members), free or {},
                               spares=[w.node_id for w in self.roster.spares], cap=cap)
        standby = self.roster.standby
        done, _ = ray.wait([w.ping for w in standby], num_returns=len(standby), timeout=0)
        kept: Counter = Counter()
        gone = []
        for w in standby:
            if (w.ping in done and not w.idle()) or kept[w.node_id] >= want.get(w.node_id, 0):
                gone.append(w)
            else:
                kept[w.node_id] += 1
        for w in gone:
            self.launcher.kill(w.actor)
        self.roster.drop(gone)
        for w in self.roster.standby:
            if w.ping in done:
                w.ping = w.actor.info.remote()
        need = [nid for nid in sorted(want) for _ in range(want[nid] - kept[nid])]
        for nid in need:
            actor = self.launcher.actor(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False),
                                        **self.slots.named(standby_kind(nid)))
            actor.warm_up.remote()  # paid while it waits; its ping (and a claim) answer after it
            self.roster.add([WorkerHandle(actor, nid, None, Role.STANDBY, ping=actor.info.remote())])
        return len(need)

    def take_standby(self, nodes: list[str]) -> list[WorkerHandle]:
        """Standbys on `nodes` (one per entry at most), each claimed (`Worker.claim`) with the slot a
        stopped member left on its node (`Slots.take_vacant`) or else a new placement group, to be
        awaited with this start like a fresh worker. A new group's bundle asks for a sliver of the node's
        `node:IP` resource too: where IPs are unique, a slot that is not free yet (the group of the
        worker it replaces still being removed) is waited for there, not taken on another node."""
        want, taken = Counter(nodes), []
        info: dict[str, dict] | None = None
        for w in self.roster.standby:
            if want[w.node_id] > 0:
                want[w.node_id] -= 1
                if (pg := self.slots.take_vacant(w.node_id)) is None:
                    info = info if info is not None else {n["NodeID"]: n for n in ray.nodes()}
                    pg = self.slots.new(w.node_id, node=info.get(w.node_id), **self.slots.named())
                w.pg = pg
                w.ping = w.actor.claim.remote(w.pg)
                taken.append(w)
        self.roster.drop(taken)
        return taken

    # -- spares --------------------------------------------------------------------------------------
    def prewarm(self, nodes: list[str]) -> int:
        """Start actors on `nodes` in the background while the group keeps training (a growth is
        settling), each warming up (`Worker.warm_up`) once started, so the resize itself only moves state
        and re-forms the process group. Returns how many were started; nodes that already have a sound
        spare are skipped (one whose start failed is stopped and started again)."""
        self.launcher.stop([w for w in self.roster.spares if not w.sound()])
        have = Counter(w.node_id for w in self.placed_spares())
        need = [nid for nid, k in (Counter(nodes) - have).items() for _ in range(k)]
        launched = self.launcher.launch(need)
        for w in launched:
            w.actor.warm_up.remote()
            w.ping = w.actor.info.remote()  # answers once the warm-up has run: `warm` reads it
        self.roster.add(launched)
        return len(need)

    def warm(self, nodes: list[str]) -> bool:
        """Whether a spare has started and warmed up on each entry of `nodes` (its `info`, sent after its
        warm-up, has answered): a growth onto them then waits for no process."""
        want = Counter(nodes)
        for w in self.placed_spares():
            if want[w.node_id] > 0 and w.answer() is not None:
                want[w.node_id] -= 1
        return not +want

    def take_spares(self, nodes: list[str]) -> list[WorkerHandle]:
        """Spares on `nodes`, taken out of the group to be awaited with this start (a spare that failed,
        or whose node died, fails the start like a fresh worker would)."""
        want, taken = Counter(nodes), []
        for w in self.placed_spares():
            if want[w.node_id] > 0:
                want[w.node_id] -= 1
                taken.append(w)
        self.roster.drop(taken)
        return taken

    def placed_spares(self) -> list[WorkerHandle]:
        """The spares, each with the node it really runs on: a spare's placement group targets its node
        softly, so where that node could not take it (full, or dead but still listed) it lands on another
        and holds that node's slot; counted on its target, it would be taken for neither node, and a start
        on the other would wait for good for the slot it holds. From its `info` answer, else from where
        its placement group landed."""
        from ray.util import placement_group_table

        for w in self.roster.spares:
            if (answer := w.answer()) is not None:
                w.node_id = answer.node_id
            elif w.pg is not None and (landed := [n for n in (placement_group_table(w.pg).get("bundles_to_node_id")
                                                                 or {}).values() if n]):
                w.node_id = landed[0]
        return self.roster.spares
