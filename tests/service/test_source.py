"""choose_source over every combination of its inputs: where the next group's state comes from."""

from __future__ import annotations

import itertools

import pytest

from parallel.layout import Layout
from parallel.planner import Plan
from service.control.policy import Fail, Noop, Resize, Wait
from service.control.source import Heal, Live, Memory, Release, Restore, choose_source

PLAN = Plan(layout=Layout(dp_replicate=2), world_size=2, available=2, micro_batch_size=1, grad_accum_steps=1,
            memory_bytes=0.0, reasons=())
HEAL = Heal(old=PLAN, ranks=(0,))
RESIZE = Resize(workers=2, cause="grow", reason="more capacity")
WAIT = Wait("too few workers")


# decision, sound, survivors, reshard -> source: every combination that can happen, written out
TABLE = [
    (RESIZE, PLAN, None, "live", Live(PLAN)),
    (RESIZE, PLAN, None, "storage", Restore(flush=True)),
    (RESIZE, None, HEAL, "live", HEAL),
    (RESIZE, None, HEAL, "storage", Restore(flush=False)),
    (RESIZE, None, None, "live", Restore(flush=False)),
    (RESIZE, None, None, "storage", Restore(flush=False)),
    (WAIT, PLAN, None, "live", Release(flush=True)),
    (WAIT, PLAN, None, "storage", Release(flush=True)),
    (WAIT, None, HEAL, "live", Release(flush=False)),
    (WAIT, None, HEAL, "storage", Release(flush=False)),
    (WAIT, None, None, "live", Release(flush=False)),
    (WAIT, None, None, "storage", Release(flush=False)),
]


@pytest.mark.parametrize("decision, sound, survivors, reshard, want", TABLE)
def test_every_combination_gives_the_source_of_the_table(decision, sound, survivors, reshard, want):
    assert choose_source(decision=decision, sound=sound, survivors=survivors, reshard=reshard) == want


def test_the_table_covers_every_combination_that_can_happen():
    cases = {(id(d), id(s), id(v), r) for d, s, v, r, _ in TABLE}
    every = {(id(d), id(s), id(v), r) for d, s, v, r in
             itertools.product([RESIZE, WAIT], [PLAN, None], [HEAL, None], ["live", "storage"])
             if s is None or v is None}
    assert cases == every


def test_a_planned_live_resize_moves_the_state_and_a_storage_one_saves_first():
    assert choose_source(decision=RESIZE, sound=PLAN, survivors=None, reshard="live") == Live(PLAN)
    assert choose_source(decision=RESIZE, sound=PLAN, survivors=None, reshard="storage") == Restore(flush=True)


def test_survivors_heal_only_under_live_resharding_and_never_while_waiting():
    assert choose_source(decision=RESIZE, sound=None, survivors=HEAL, reshard="live") is HEAL
    assert choose_source(decision=RESIZE, sound=None, survivors=HEAL, reshard="storage") == Restore()
    assert choose_source(decision=WAIT, sound=None, survivors=HEAL, reshard="live") == Release(flush=False)


def test_a_sound_group_that_must_wait_saves_before_it_lets_go():
    assert choose_source(decision=WAIT, sound=PLAN, survivors=None, reshard="live") == Release(flush=True)


@pytest.mark.parametrize("kw, message", [
    ({"decision": RESIZE, "sound": PLAN, "survivors": HEAL, "reshard": "live"}, "not both"),
    ({"decision": RESIZE, "sound": None, "survivors": None, "reshard": "disk"}, "reshard must be one of"),
    ({"decision": Noop(), "sound": None, "survivors": None, "reshard": "live"}, "only a Resize or a Wait"),
    ({"decision": Fail("x"), "sound": PLAN, "survivors": None, "reshard": "live"}, "only a Resize or a Wait"),
])
def test_inputs_that_cannot_happen_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        choose_source(**kw)


FSDP = Plan(layout=Layout(dp_shard=3), world_size=3, available=3, micro_batch_size=1, grad_accum_steps=1,
            memory_bytes=0.0, reasons=())
MEMORY = Memory(old=FSDP, step=12, serve=((0, 0), (1, 2), (2, 2)))


@pytest.mark.parametrize("decision, reshard, want", [
    (RESIZE, "live", MEMORY),
    (RESIZE, "storage", Restore()),
    (WAIT, "live", Release(flush=False)),
])
def test_snapshots_in_memory_form_the_next_group_only_under_live_resharding(decision, reshard, want):
    assert choose_source(decision=decision, sound=None, survivors=MEMORY, reshard=reshard) == want
