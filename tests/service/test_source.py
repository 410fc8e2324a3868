"""choose_source over every combination of its inputs: where the next group's state comes from."""

from __future__ import annotations

import itertools

import pytest

from parallel.layout import Layout
from parallel.planner import Plan
from service.control.policy import Fail, Noop, Resize, Wait
from parallel.peers import Cover, NoCover
from service.control.source import Heal, Live, Memory, Release, Restore, choose_source, from_survivors

PLAN = Plan(layout=Layout(dp_replicate=2), world_size=2, available=2, micro_batch_size=1, grad_accum_steps=1,
            memory_bytes=0.0, reasons=())
HEAL = Heal(old=PLAN, ranks=(0,))
RESIZE = Resize(workers=2, cause="grow", reason="more capacity")
WAIT = Wait("too few workers")


def expected(decision, sound, survivors, reshard):
    """The rule, written out as a table a reader can check line by line."""
    if isinstance(decision, Wait):
        return Release(flush=sound is not None)
    if sound is not None:
        return Live(sound) if reshard == "live" else Restore(flush=True)
    if survivors is not None and reshard == "live":
        return survivors
    return Restore(flush=False)


@pytest.mark.parametrize("decision, sound, survivors, reshard", [
    c for c in itertools.product([RESIZE, WAIT], [PLAN, None], [HEAL, None], ["live", "storage"])
    if not (c[1] is not None and c[2] is not None)])
def test_every_combination_gives_the_source_of_the_table(decision, sound, survivors, reshard):
    assert choose_source(decision=decision, sound=sound, survivors=survivors, reshard=reshard) == \
        expected(decision, sound, survivors, reshard)


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


@pytest.mark.parametrize("live, memory, want", [
    ((0, 2), Cover(step=12, serve={0: 0, 1: 2, 2: 2}), Heal(old=FSDP, ranks=(0, 2))),  # live state first: 0 redone
    (None, Cover(step=12, serve={2: 2, 0: 0, 1: 2}), MEMORY),
    (None, Cover(step=10, serve={0: 0, 1: 2, 2: 2}), Memory(old=FSDP, step=10, serve=((0, 0), (1, 2), (2, 2)))),
    (None, NoCover("rank 1 and its buddy were both lost"),
     "the live state does not hold every shard, and rank 1 and its buddy were both lost"),
    (None, None, "the live state does not hold every shard, and peer snapshots are off"),
])
def test_survivors_offer_their_live_state_else_their_snapshots_else_say_why(live, memory, want):
    assert from_survivors(FSDP, live=live, memory=memory) == want


@pytest.mark.parametrize("decision, reshard, want", [
    (RESIZE, "live", MEMORY),
    (RESIZE, "storage", Restore()),
    (WAIT, "live", Release(flush=False)),
])
def test_snapshots_in_memory_form_the_next_group_only_under_live_resharding(decision, reshard, want):
    assert choose_source(decision=decision, sound=None, survivors=MEMORY, reshard=reshard) == want
