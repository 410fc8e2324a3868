"""service.pool.worker_group.transfer_calls: a state transfer's per-member arguments, the maps with an
entry per rank shared by reference instead of copied into each of the N calls."""

from __future__ import annotations

import pytest

from service.pool.worker_group import transfer_calls


def _calls(n_old: int, n_new: int):
    put_sizes: list[int] = []

    def put(value):
        put_sizes.append(len(value))
        return object()  # an opaque reference, as ray.put's

    everyone = [f"node{g // 2}" for g in range(max(n_old, n_new))]
    calls = transfer_calls(everyone=everyone, old_ranks=list(range(n_old)),
                           group_to_new={g: g for g in range(n_new)}, old_to_group={r: r for r in range(n_old)},
                           new_to_group={r: r for r in range(n_new)}, put=put)
    return calls, put_sizes


@pytest.mark.parametrize("n", [64, 256, 1024])
def test_the_per_rank_maps_are_put_once_and_each_call_carries_a_constant_size(n):
    calls, put_sizes = _calls(n, n * 3 // 4)
    assert len(calls) == n
    assert len(put_sizes) == 3 and sum(put_sizes) == n + n * 3 // 4 + n  # O(N) entries serialised, once
    for key in ("old_to_group", "new_to_group", "nodes"):
        assert len({id(c[key]) for c in calls}) == 1  # the same reference in every call
    # nothing else in a call grows with N (the old calls carried all three maps: 2.75 N entries each)
    assert all(not isinstance(v, dict) for c in calls for v in c.values())


def test_each_member_gets_its_ranks():
    calls, _ = _calls(4, 3)
    assert [(c["rank"], c["world_size"], c["old_rank"], c["new_rank"]) for c in calls] == [
        (0, 4, 0, 0), (1, 4, 1, 1), (2, 4, 2, 2), (3, 4, 3, None)]
    joiner, _ = _calls(2, 3)
    assert [(c["old_rank"], c["new_rank"]) for c in joiner] == [(0, 0), (1, 1), (None, 2)]
