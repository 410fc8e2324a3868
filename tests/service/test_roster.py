"""The roster of a group's workers without Ray running: members first in rank order, every other
handle keeping its role and place, handles told apart by identity."""

from __future__ import annotations

from service.pool.roster import Role, Roster, WorkerHandle


def _handle(node: str, role: Role) -> WorkerHandle:
    return WorkerHandle(actor=None, node_id=node, pg=None, role=role)


def test_new_members_come_first_in_their_order_and_the_others_keep_their_roles():
    r = Roster()
    m0, m1, spare, standby = _handle("b", Role.MEMBER), _handle("a", Role.MEMBER), _handle("a", Role.SPARE), \
        _handle("c", Role.STANDBY)
    r.workers = [spare, m0, standby, m1]
    assert r.members == [m0, m1] and r.spares == [spare] and r.standby == [standby]
    assert r.member_nodes() == ["a", "b"]
    r.set_members([m1, spare])  # a spare taken as a rank; m0 left out (the caller stops it)
    assert r.members == [m1, spare] and spare.role is Role.MEMBER
    assert r.workers == [m1, spare, standby]

