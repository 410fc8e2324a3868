"""Pure tests of the shared-cluster scheduling policy (tier 1: no Ray, no clock)."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from service.sharing.ledger import Holding, Ledger, NodeCapacity, WorkerShape
from service.sharing.scheduler import Grow, JobRequest, Preempt, Phase, Queued, Quota, Shrink, Start, schedule

CPU = WorkerShape(cpus=1.0)
R, P, Q = Phase.RUNNING, Phase.PAUSED, Phase.QUEUED


def ledger(cpus: dict[str, float], held: dict[str, dict[str, int]] | None = None, *, shape: WorkerShape = CPU,
           gpus: dict[str, float] | None = None, **node_kw) -> Ledger:
    nodes = tuple(NodeCapacity(node_id=n, cpus=c, gpus=(gpus or {}).get(n, 0.0), **node_kw.get(n, {}))
                  for n, c in sorted(cpus.items()))
    hs = tuple(Holding.of(j, shape, on) for j, on in sorted((held or {}).items()))
    return Ledger(nodes=nodes, holdings=hs)


def job(job_id: str, phase: Phase = Q, **kw) -> JobRequest:
    return JobRequest(job_id=job_id, phase=phase, **kw)


def sizes(s) -> dict[str, int]:
    return {h.job_id: h.workers for h in s.ledger.holdings}


# -- admission and the queue ------------------------------------------------------------------------------
def test_a_queued_job_on_an_empty_cluster_gets_up_to_its_max():
    s = schedule(ledger({"a": 4, "b": 4}), [job("x", min_workers=2, max_workers=6)])
    assert s.grants == (Start(job_id="x", workers=6, nodes=(("a", 4), ("b", 2)),
                              reason="admitted on 6 workers (min 2, priority 0)"),)
    assert s.grant("x") == {"a": 4, "b": 2}


def test_a_job_whose_min_does_not_fit_is_queued_with_its_position_and_reason():
    led = ledger({"a": 4}, {"r": {"a": 3}})
    s = schedule(led, [job("r", R, min_workers=3, max_workers=3), job("big", min_workers=2, submitted=1),
                       job("huge", min_workers=9, submitted=2)])
    assert s.grants == () and s.resizes == ()
    assert [(q.job_id, q.position) for q in s.queued] == [("big", 1), ("huge", 2)]
    assert "needs 2 workers of 1 CPU; 1 can be granted" in s.queued[0].reason
    assert "the whole cluster fits 4" in s.queued[1].reason


def test_a_small_job_behind_a_big_one_is_backfilled():
    s = schedule(ledger({"a": 4}, {"r": {"a": 2}}), [
        job("r", R, min_workers=2, max_workers=2), job("big", min_workers=4, submitted=1),
        job("small", min_workers=1, max_workers=1, submitted=2)])
    assert [g.job_id for g in s.grants] == ["small"]
    assert s.decision("big") == Queued(job_id="big", position=1, reason=s.queued[0].reason)


def test_gpu_workers_fit_per_node_not_across_nodes():
    two_gpu = WorkerShape(cpus=1, gpus=2)
    led = ledger({"a": 8, "b": 8}, gpus={"a": 1, "b": 3})
    s = schedule(led, [job("g", min_workers=1, shape=two_gpu)])
    assert s.grant("g") == {"b": 1}
    s = schedule(led, [job("g", min_workers=2, shape=two_gpu)])
    assert s.grants == () and "the whole cluster fits 1" in s.queued[0].reason


# -- priorities: shrink first, then pause ----------------------------------------------------------------
def test_a_higher_priority_job_is_admitted_by_shrinking_lower_ones_toward_their_min():
    led = ledger({"a": 4, "b": 4}, {"l1": {"a": 4}, "l2": {"b": 4}})
    jobs = [job("l1", R, min_workers=2, priority=1, submitted=0), job("l2", R, min_workers=2, priority=1, submitted=1),
            job("h", min_workers=4, max_workers=4, priority=10, submitted=2)]
    s = schedule(led, jobs)
    assert s.pauses == ()
    assert {r.job_id: (r.before, r.after) for r in s.resizes} == {"l1": (4, 2), "l2": (4, 2)}
    assert s.decision("l1").reason == "shrunk 4→2 to admit job h (priority 10)"
    assert s.grants[0].job_id == "h" and s.grants[0].workers == 4
    # the shrunk jobs keep their nodes: a planned resize that moves nobody
    assert s.grant("l1") == {"a": 2} and s.grant("l2") == {"b": 2} and s.grant("h") == {"a": 2, "b": 2}


def test_only_when_shrinking_is_not_enough_is_the_lowest_job_paused():
    led = ledger({"a": 8}, {"mid": {"a": 4}, "low": {"a": 4}})
    jobs = [job("mid", R, min_workers=2, priority=5), job("low", R, min_workers=2, priority=1),
            job("h", min_workers=6, max_workers=6, priority=10)]
    s = schedule(led, jobs)
    assert s.pauses == (Preempt(job_id="low", before=4,
                              reason="paused (checkpoint first, was 4 workers) to admit job h (priority 10)"),)
    assert s.decision("mid") == Shrink(job_id="mid", before=4, after=2, nodes=(("a", 2),),
                                       reason="shrunk 4→2 to admit job h (priority 10)")
    assert sizes(s) == {"h": 6, "mid": 2}


def test_a_lower_priority_job_never_shrinks_a_higher_one():
    led = ledger({"a": 8}, {"h": {"a": 8}})
    s = schedule(led, [job("h", R, min_workers=2, priority=10), job("l", min_workers=1, priority=1)])
    assert s.resizes == () and s.grants == ()
    assert "without taking them from jobs of priority >= 1" in s.decision("l").reason


def test_a_job_whose_nodes_a_higher_one_took_is_paused_not_kept_on_the_extras_of_an_even_higher_one():
    # new (priority 1) is admitted on lo's node; lo must not then keep its minimum on what hi (priority 5)
    # holds above its own: that would shrink hi to admit new
    led = ledger({"a": 4, "b": 4}, {"hi": {"b": 4}, "lo": {"a": 4}})
    s = schedule(led, [job("hi", R, priority=5), job("lo", R, min_workers=2),
                       job("new", min_workers=4, max_workers=4, priority=1)])
    assert s.grant("hi") == {"b": 4} and s.grant("new") == {"a": 4} and s.resizes == ()
    assert s.pauses == (Preempt(job_id="lo", before=4,
                              reason="paused (checkpoint first, was 4 workers) to admit job new (priority 1)"),)


def test_freed_capacity_goes_back_in_priority_order_and_resumes_paused_jobs():
    # h finished: 8 workers free; mid was shrunk to 2, low was paused
    led = ledger({"a": 8}, {"mid": {"a": 2}})
    jobs = [job("mid", R, min_workers=2, max_workers=6, priority=5), job("low", P, min_workers=2, priority=1)]
    s = schedule(led, jobs)
    assert s.returns == (
        Grow(job_id="mid", before=2, after=6, nodes=(("a", 6),),
             reason="grown 2→6: capacity given back in priority order (priority 5)"),
        Grow(job_id="low", before=0, after=2, nodes=(("a", 2),),
             reason="resumed on 2 workers: capacity given back in priority order (priority 1)"))


def test_a_paused_job_waits_its_turn_ahead_of_queued_ones_of_equal_priority():
    s = schedule(ledger({"a": 2}), [job("new", min_workers=2, submitted=0), job("old", P, min_workers=2, submitted=5)])
    assert s.decision("old").after == 2 and s.decision("new").position == 1


def test_a_running_job_is_not_paused_for_an_equal_priority_one():
    led = ledger({"a": 4}, {"r": {"a": 4}})
    s = schedule(led, [job("r", R, min_workers=4, submitted=5), job("q", min_workers=2, submitted=0)])
    assert s.pauses == () and s.decision("q").position == 1


# -- equal priorities share fairly ---------------------------------------------------------------------------
def test_equal_priorities_get_their_minimum_then_the_rest_by_weight():
    led = ledger({"a": 12}, {"e1": {"a": 12}})
    s = schedule(led, [job("e1", R, min_workers=2, weight=1.0), job("e2", min_workers=2, weight=3.0, submitted=1)])
    # 12 = 2 + 2 minimums, 8 extras split 1:3
    assert sizes(s) == {"e1": 4, "e2": 8}
    assert s.decision("e1").reason == "shrunk 12→4 to admit job e2 (priority 0)"


def test_higher_priority_extras_come_before_lower_ones_but_never_displace_a_minimum():
    led = ledger({"a": 8}, {"h": {"a": 2}, "l": {"a": 6}})
    s = schedule(led, [job("h", R, min_workers=2, priority=9), job("l", R, min_workers=2, priority=1)])
    assert sizes(s) == {"h": 6, "l": 2}
    assert s.decision("l").reason == "shrunk 6→2 to give job h (priority 9) its share"


# -- quotas ----------------------------------------------------------------------------------------------
def test_quota_on_jobs_running_queues_the_owners_next_job():
    s = schedule(ledger({"a": 8}), [job("a1", owner="ann", submitted=0), job("a2", owner="ann", submitted=1),
                                    job("b1", owner="bob", submitted=2)], {"ann": Quota(max_jobs=1)})
    assert {g.job_id for g in s.grants} == {"a1", "b1"}
    assert s.decision("a2").reason == "owner ann already runs 1 of the 1 jobs its quota allows"


def test_quota_on_workers_caps_growth_and_admission():
    s = schedule(ledger({"a": 16}), [job("a1", owner="ann", min_workers=2), job("a2", owner="ann", min_workers=3,
                                                                                submitted=1)],
                 {"ann": Quota(max_workers=4)})
    assert sizes(s) == {"a1": 4}
    assert "owner ann's jobs ahead of it keep 2 of the 4 its quota allows (they hold 0 now)" in s.decision("a2").reason


def test_a_quota_reason_gives_what_the_owner_holds_and_says_when_the_minimum_is_above_the_quota():
    led = ledger({"a": 8}, {"a1": {"a": 2}})
    s = schedule(led, [job("a1", R, owner="ann", min_workers=1), job("a2", owner="ann", min_workers=2, submitted=1),
                       job("a3", owner="ann", min_workers=3, priority=5, submitted=2)], {"ann": Quota(max_workers=2)})
    assert sizes(s) == {"a1": 2}
    assert s.decision("a3").reason == "needs 3 workers but owner ann's quota allows 2: it cannot start until the " \
                                      "quota grows"
    assert s.decision("a2").reason == "needs 2 workers but owner ann's jobs ahead of it keep 1 of the 2 its quota " \
                                      "allows (they hold 2 now)"


def test_a_lowered_quota_shrinks_a_running_job_and_says_so():
    led = ledger({"a": 8}, {"a1": {"a": 8}})
    s = schedule(led, [job("a1", R, owner="ann", min_workers=1)], {"ann": Quota(max_workers=3)})
    assert s.decision("a1").after == 3 and "quota" in s.decision("a1").reason


# -- the ledger's view -------------------------------------------------------------------------------------
def test_capacity_used_outside_the_service_is_never_granted():
    led = ledger({"a": 8}, a={"outside_cpus": 5.0})
    s = schedule(led, [job("x", min_workers=1)])
    assert sizes(s) == {"x": 3}


def test_holdings_of_jobs_not_listed_stay_put():
    led = ledger({"a": 8}, {"ghost": {"a": 5}})
    assert sizes(schedule(led, [job("x")])) == {"ghost": 5, "x": 3}


def test_workers_on_a_draining_node_are_not_granted_again():
    led = ledger({"a": 4, "b": 4}, {"r": {"a": 2, "b": 2}}, b={"usable": False})
    s = schedule(led, [job("r", R, min_workers=1)])
    assert s.grant("r") == {"a": 4}


# -- placement: a resize keeps the workers where they are --------------------------------------------------
def test_a_shrink_keeps_the_job_on_the_nodes_it_holds():
    # found by benchmarks/shared_cluster.py: r0 was shrunk onto n0:2, n1:2, moving a worker to n0
    led = ledger({"n0": 4, "n1": 4}, {"r0": {"n0": 1, "n1": 4}})
    s = schedule(led, [job("r0", R, priority=5, max_workers=6), job("q", priority=5, max_workers=6, submitted=1)])
    assert s.decision("r0").after == 4
    assert s.grant("r0") == {"n1": 4} and s.grant("q") == {"n0": 4}


def test_a_grow_keeps_every_worker_the_job_holds():
    s = schedule(ledger({"a": 4, "b": 4}, {"r": {"a": 1, "b": 3}}), [job("r", R, max_workers=6)])
    assert s.grant("r") == {"a": 2, "b": 4}  # was a:4, b:2: one worker moved from b


def test_a_worker_that_needs_a_whole_node_may_still_move_a_running_job():
    # pass 3 cannot keep r on a:1, b:1 and fit a 4-CPU worker: the packing of passes 1 and 2 stands
    led = ledger({"a": 4, "b": 4}, {"r": {"a": 1, "b": 1}})
    s = schedule(led, [job("r", R, min_workers=2, max_workers=2), job("x", priority=10, shape=WorkerShape(cpus=4))])
    assert s.grant("x") == {"a": 1} and s.grant("r") == {"b": 2}


@pytest.mark.parametrize("kw, match", [
    ({"min_workers": 0}, "min_workers"), ({"min_workers": 4, "max_workers": 2}, "max_workers"),
    ({"weight": 0}, "weight"), ({"priority": 1.5}, "priority"), ({"job_id": ""}, "job_id")])
def test_bad_requests_are_refused_with_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        JobRequest(**{"job_id": "x", **kw})


def test_inconsistent_inputs_are_refused():
    with pytest.raises(ValueError, match="listed twice"):
        schedule(ledger({"a": 1}), [job("x"), job("x")])
    with pytest.raises(ValueError, match="only a running job holds workers"):
        schedule(ledger({"a": 2}, {"x": {"a": 1}}), [job("x", Q)])
    with pytest.raises(ValueError, match="quota max_jobs"):
        Quota(max_jobs=-1)


# -- properties over many random scenarios -------------------------------------------------------------------
def _scenario(seed: int):
    rng = random.Random(seed)
    cpus = {f"n{i}": float(rng.choice([2, 4, 8])) for i in range(rng.randint(1, 4))}
    free = dict(cpus)
    held, jobs = {}, []
    for k in range(rng.randint(1, 7)):
        lo = rng.randint(1, 4)
        hi = rng.choice([None, lo, lo + rng.randint(0, 6)])
        phase = rng.choice([R, R, P, Q])
        if phase is R:  # a running job holds between its min and max, where it fits
            want, on = rng.randint(lo, hi or lo + 4), {}
            for n in sorted(free):
                t = min(int(free[n]), want - sum(on.values()))
                if t > 0:
                    on[n], free[n] = t, free[n] - t
            if sum(on.values()) < lo:
                for n, t in on.items():
                    free[n] += t
                phase, on = Q, {}
            else:
                held[f"j{k}"] = on
        jobs.append(job(f"j{k}", phase, owner=rng.choice("ab"), priority=rng.choice([0, 1, 5]), min_workers=lo,
                        max_workers=hi, weight=rng.choice([1.0, 2.0]), submitted=float(rng.randint(0, 3))))
    quotas = {o: Quota(max_workers=rng.choice([None, 4, 9]), max_jobs=rng.choice([None, 1, 2])) for o in "ab"}
    return ledger(cpus, held), jobs, quotas


@pytest.mark.parametrize("seed", range(300))
def test_invariants_hold_on_random_scenarios(seed):
    led, jobs, quotas = _scenario(seed)
    s = schedule(led, jobs, quotas)
    by_id = {j.job_id: j for j in jobs}
    after = sizes(s)
    # never more than capacity, on any node
    assert s.ledger.overcommitted() == {}
    for n in s.ledger.nodes:
        assert sum(h.as_dict().get(n.node_id, 0) for h in s.ledger.holdings) <= n.cpus
    # every job runs within [min, max] or holds nothing (a running job below its min only when paused)
    for jid, w in after.items():
        assert by_id[jid].min_workers <= w <= by_id[jid].cap
    for j in jobs:
        d = s.decision(j.job_id)
        if j.phase is R and not after.get(j.job_id):
            assert isinstance(d, Preempt)
        if j.job_id not in after:
            assert isinstance(d, (Preempt, Queued))
    # quotas never exceeded
    for owner, q in quotas.items():
        mine = [w for jid, w in after.items() if by_id[jid].owner == owner]
        assert q.max_jobs is None or len(mine) <= q.max_jobs
        assert q.max_workers is None or sum(mine) <= q.max_workers
    # a job is shrunk only for a job of priority >= its own, paused only for a higher one, or for a
    # limit of its own (quota, max_workers), and the reason says which (no capacity is lost here)
    for d, higher in [(r, False) for r in s.resizes] + [(p, True) for p in s.pauses]:
        if m := re.search(r"job (\S+) \(priority", d.reason):
            assert by_id[m[1]].priority - by_id[d.job_id].priority >= (1 if higher else 0), d
            assert m[1] in after
        else:
            assert re.search(r"quota|max_workers", d.reason), d
    # queue positions are 1..n
    assert [q.position for q in s.queued] == list(range(1, len(s.queued) + 1))
    # deterministic: the same inputs in any order give the same schedule
    shuffled = list(jobs)
    random.Random(seed + 1).shuffle(shuffled)
    assert schedule(led, shuffled, dict(reversed(list(quotas.items())))) == s


@pytest.mark.parametrize("seed", range(100))
def test_a_schedule_carried_out_is_stable(seed):
    """Scheduling again from the ledger a schedule produced changes nothing: no resize ping-pong."""
    led, jobs, quotas = _scenario(seed)
    s = schedule(led, jobs, quotas)
    after = sizes(s)
    phase = {j.job_id: (R if j.job_id in after else (P if j.phase is not Q else Q)) for j in jobs}
    again = [JobRequest(**{**{f: getattr(j, f) for f in j.__slots__}, "phase": phase[j.job_id]}) for j in jobs]
    s2 = schedule(s.ledger, again, quotas)
    assert (s2.grants, s2.resizes, s2.pauses, s2.returns) == ((), (), (), ())
    assert sizes(s2) == after


@pytest.mark.parametrize("seed", range(300))
def test_a_running_job_never_gains_a_worker_on_one_node_while_losing_one_on_another(seed):
    """A shrink keeps a subset of the workers the job holds, a grow all of them: a resize moves no one. Only
    a node that starts draining (a third of the scenarios) takes workers away that come back elsewhere."""
    led, jobs, quotas = _scenario(seed)
    rng = random.Random(-1 - seed)
    if rng.random() < 1 / 3:
        gone = rng.choice(led.nodes).node_id
        led = dataclasses.replace(led, nodes=tuple(dataclasses.replace(n, usable=n.node_id != gone)
                                                   for n in led.nodes))
    s = schedule(led, jobs, quotas)
    usable = {n.node_id for n in led.nodes if n.usable}
    for h in led.holdings:
        was, now = {nid: k for nid, k in h.nodes if nid in usable}, s.grant(h.job_id)
        gains = sorted(nid for nid, k in now.items() if k > was.get(nid, 0))
        loses = sorted(nid for nid, k in was.items() if k > now.get(nid, 0))
        assert not (gains and loses), f"{h.job_id} held {was}, granted {now}"


def test_lost_capacity_shrinks_then_pauses_and_says_so():
    led = ledger({"a": 4, "b": 4}, {"hi": {"a": 2, "b": 2}, "lo": {"a": 2, "b": 2}}, b={"usable": False})
    s = schedule(led, [job("hi", R, min_workers=1, priority=5), job("lo", R, min_workers=2, priority=1)])
    assert s.decision("hi") == Shrink(job_id="hi", before=4, after=2, nodes=(("a", 2),), reason=(
        "shrunk 4→2 because the cluster has less capacity (a node left, is draining, or is used outside the service)"))
    assert s.decision("lo").after == 2
    s = schedule(led, [job("hi", R, min_workers=3, priority=5), job("lo", R, min_workers=2, priority=1)])
    assert s.decision("lo") == Preempt(job_id="lo", before=4, reason=(
        "paused (checkpoint first, was 4 workers) because the cluster has less capacity (a node left, is "
        "draining, or is used outside the service)"))
    assert "lo" not in sizes(s)
