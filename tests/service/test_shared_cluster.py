"""Tier 1: one scheduling round of the service (service.sharing.rounds.plan_round), pure: from the jobs'
statuses to what their coordinators are told."""

from __future__ import annotations

from service.pool.cluster import snapshot_from
from service.sharing.scheduler import JobRequest, Phase, Quota
from service.control.commands import Grant, Pause, Resume
from service.sharing.rounds import JobView, plan_round


def cluster(**cpus: int):
    return snapshot_from([{"NodeID": nid, "Alive": True, "Resources": {"CPU": float(c)}} for nid, c in cpus.items()],
                         {}, now=0.0)


_ASKS = {"owner", "weight", "shape"}
"""JobRequest fields a test may give `job` besides lo, hi, prio and t; the other keywords are the view's."""


def job(job_id, *, state="RUNNING", held=None, grant=None, lo=1, hi=None, prio=0, t=0.0, **kw) -> JobView:
    asks = {k: kw.pop(k) for k in _ASKS & kw.keys()}
    return JobView(request=JobRequest(job_id=job_id, min_workers=lo, max_workers=hi, priority=prio, submitted=t, **asks),
                   state=state, held=held or {}, grant=grant, **kw)


def by_job(actions):
    """The commands each job is told, in order."""
    out: dict[str, list] = {}
    for a in actions:
        out.setdefault(a.job_id, []).append(a.command)
    return out


def test_phases_follow_the_status():
    assert job("a", state="QUEUED").phase is Phase.QUEUED
    assert job("a", state="PENDING", grant={}).phase is Phase.QUEUED  # holds nothing yet
    assert job("a", state="STARTING", grant={"n": 2}).phase is Phase.RUNNING  # granted, group forming
    assert job("a", state="PAUSED", cause="scheduler").phase is Phase.PAUSED
    assert job("a", state="PAUSED", cause="user").phase is None  # a user's pause is left alone
    assert job("a", state="SUCCEEDED", held={"n": 1}).phase is None
    assert job("a", state="UNKNOWN", held={"n": 1}).phase is None
    # shrinking: it holds its old workers until its group has shrunk; growing: its grant
    assert job("a", held={"n": 4}, grant={"n": 2}).holding() == {"n": 4}
    assert job("a", held={"n": 2}, grant={"n": 2, "m": 2}).holding() == {"m": 2, "n": 2}


def test_a_queued_job_is_started_on_free_workers_and_told_its_place_otherwise():
    r = plan_round(cluster(n=4), [job("a", state="QUEUED", lo=2, hi=2, t=1), job("b", state="QUEUED", lo=4, t=2)])
    acts = by_job(r.actions)
    assert acts["a"] == [Grant(nodes={"n": 2}, reason="admitted on 2 workers (min 2, priority 0)")]
    (b,) = acts["b"]
    assert b.nodes == {} and b.queue_position == 1 and "needs 4 workers" in b.reason
    # told once: the same place and reason are not sent again
    again = plan_round(cluster(n=4), [job("a", grant={"n": 2}, lo=2, hi=2, t=1),
                                      job("b", state="QUEUED", grant={}, lo=4, t=2, queue_position=1, reason=b.reason)])
    assert again.actions == ()


def test_a_higher_priority_job_waits_for_the_shrink_it_causes_then_starts():
    low = job("low", held={"n": 4}, grant={"n": 4}, lo=2, t=1)
    high = job("high", state="QUEUED", lo=2, hi=2, prio=10, t=2)
    r = plan_round(cluster(n=4), [low, high])
    assert [a.job_id for a in r.actions] == ["low", "high"]  # what frees workers is sent first
    acts = by_job(r.actions)
    assert acts["low"] == [Grant(nodes={"n": 2}, reason="shrunk 4→2 to admit job high (priority 10)")]
    (h,) = acts["high"]
    assert h.nodes == {} and "waiting for the workers" in h.reason  # low still runs on them

    # next round: low was told 2 but its group still runs 4 -> high still waits, nothing is sent twice
    low = job("low", held={"n": 4}, grant={"n": 2}, lo=2, t=1)
    high = job("high", state="QUEUED", grant={}, lo=2, hi=2, prio=10, t=2, queue_position=1, reason=h.reason)
    assert plan_round(cluster(n=4), [low, high]).actions == ()

    # low's group has shrunk: high is started on the two workers it gave up
    low = job("low", held={"n": 2}, grant={"n": 2}, lo=2, t=1)
    acts = by_job(plan_round(cluster(n=4), [low, high]).actions)
    assert acts == {"high": [Grant(nodes={"n": 2},
                                      reason="admitted on 2 workers (min 2, priority 10)")]}


def test_pause_is_sent_at_once_and_a_paused_job_is_resumed_once_capacity_is_free():
    low = job("low", held={"n": 2}, grant={"n": 2}, lo=2, t=1)
    high = job("high", state="QUEUED", lo=4, hi=4, prio=5, t=2)
    acts = by_job(plan_round(cluster(n=4), [low, high]).actions)
    assert acts["low"] == [Pause(by="scheduler", reason="paused (checkpoint first, was 2 workers) to admit job "
                                                         "high (priority 5)")]
    # low is paused (by the scheduler) and high finished: low gets its workers back and is resumed
    low = job("low", state="PAUSED", cause="scheduler", grant={"n": 2}, lo=2, t=1)
    done = job("high", state="SUCCEEDED", held={}, grant={"n": 4}, lo=4, prio=5, t=2)
    acts = by_job(plan_round(cluster(n=4), [low, done]).actions)
    assert acts["low"][0].nodes == {"n": 4} and acts["low"][1] == Resume(by="scheduler")
    assert "high" not in acts


def test_a_user_paused_job_gives_its_grant_back_and_an_unknown_job_keeps_what_it_held():
    acts = by_job(plan_round(cluster(n=4), [job("p", state="PAUSED", cause="user", grant={"n": 2}),
                                            job("u", state="UNKNOWN", held={"n": 3}),
                                            job("q", state="QUEUED", lo=1, hi=4, t=3)]).actions)
    assert acts["p"][0].nodes == {}
    assert acts["q"] == [Grant(nodes={"n": 1}, reason="admitted on 1 workers (min 1, priority 0)")]
    assert "u" not in acts


def test_workers_used_outside_the_service_are_never_granted():
    r = plan_round(cluster(n=4), [job("q", state="QUEUED", lo=1, hi=4)], in_use={"n": (3.0, 0.0)})
    assert r.ledger.node("n").outside_cpus == 3.0
    assert by_job(r.actions)["q"][0].nodes == {"n": 1}


def test_a_grant_is_sent_to_a_running_job_that_never_had_one_and_quotas_hold():
    a = job("a", held={"n": 2}, grant=None, owner="ann", t=1)
    b = job("b", state="QUEUED", owner="ann", t=2)
    acts = by_job(plan_round(cluster(n=4), [a, b], {"ann": Quota(max_jobs=1)}).actions)
    assert acts["a"][0].nodes == {"n": 4} and acts["a"][0].reason.startswith("grown 2→4")  # no max_workers: all
    assert "quota" in acts["b"][0].reason and acts["b"][0].queue_position == 1


def test_grants_stop_at_what_the_job_can_use_so_no_worker_sits_idle():
    even = lambda n: n - n % 2 or None  # noqa: E731  (a job whose layouts need an even world size)
    r = plan_round(cluster(n=5), [job("a", state="QUEUED", lo=2, size_for=even, t=1),
                                  job("b", state="QUEUED", lo=1, hi=1, t=2)])
    acts = by_job(r.actions)
    assert acts["a"][0].nodes == {"n": 4}  # not 5: the fifth would idle
    assert acts["b"][0].nodes == {"n": 1}  # ... and goes to b instead
    r = plan_round(cluster(n=5), [job("a", state="QUEUED", lo=2, hi=3, size_for=even)])
    assert by_job(r.actions)["a"][0].nodes == {"n": 2}


def test_standbys_count_against_the_owners_worker_quota_and_get_what_the_members_leave():
    from service.sharing.rounds import standby_caps

    a, b, c = (job(x, owner=o, standby_per_node=s, t=t) for x, o, s, t in
               (("a", "ann", 8, 1), ("b", "ann", 1, 2), ("c", "bob", 8, 3)))
    grants = {"a": {"n": 1}, "b": {"n": 1, "m": 1}, "c": {"n": 1}}
    # ann: 4 workers, 3 of them members; a (first) may keep what is left, b none; bob has no worker quota
    assert standby_caps([a, b, c], grants, {"ann": Quota(max_workers=4)}) == {"a": 1, "b": 0, "c": None}
    # room enough: each up to what its placement keeps (per node, and the busiest node's count once more)
    assert standby_caps([a, b], grants, {"ann": Quota(max_workers=100)}) == {"a": 9, "b": 3}
    assert standby_caps([a], {"a": {}}, {"ann": Quota(max_workers=4)}) == {"a": 0}
    # the cap is sent with the grant, and sent again when only the cap changes
    r = plan_round(cluster(n=4), [job("d", held={"n": 1}, grant={"n": 1}, hi=1, owner="ann", standby_per_node=8)],
                   {"ann": Quota(max_workers=3)})
    [g] = by_job(r.actions)["d"]
    assert isinstance(g, Grant) and g.nodes == {"n": 1} and g.standby == 2
    r = plan_round(cluster(n=4), [job("d", held={"n": 1}, grant={"n": 1}, hi=1, owner="ann", standby_per_node=8,
                                      standby_cap=2)], {"ann": Quota(max_workers=3)})
    assert "d" not in by_job(r.actions)
