"""Tier 2: jobs sharing one (fake) cluster through the API (issue 16): admission, the queue, priorities
that shrink or pause lower jobs and give the workers back, quotas, and the scheduler's reasons as events."""

from __future__ import annotations

import threading

from fastapi.testclient import TestClient

from service.sharing.scheduler import Quota
from tests.api.helpers import SPEC, make_app, make_launcher, stop_all, wait_for

J = "/api/v1/jobs"


def spec(name: str, *, lo: int, hi: int, priority: int = 0, steps: int = 60) -> dict:
    return {**SPEC, "name": name, "train": {**SPEC["train"], "steps": steps},
            "parallel": {"min_workers": lo, "max_workers": hi}, "scheduling": {"priority": priority}}


def job(c, job_id):
    return c.get(f"{J}/{job_id}").json()


def told(c, job_id) -> list[str]:
    return [e["reason"] for e in c.get(f"{J}/{job_id}/events").json() if e["kind"] == "schedule"]


def test_a_higher_priority_job_shrinks_a_running_one_and_gives_the_workers_back(tmp_path):
    launcher, _ = make_launcher({"a": 2, "b": 2}, step_s=0.02)
    try:
        with TestClient(make_app(tmp_path, launcher, schedule=True)) as c:
            low = c.post(J, json={"spec": spec("low", lo=2, hi=4, steps=150)}).json()["id"]
            wait_for(lambda: job(c, low)["world_size"] == 4 and job(c, low)["step"] >= 2, what="low on 4")
            assert job(c, low)["held"] == {"a": 2, "b": 2}

            high = c.post(J, json={"spec": spec("high", lo=2, hi=2, priority=10, steps=10)}).json()["id"]
            wait_for(lambda: job(c, high)["state"] == "SUCCEEDED", timeout=30, what="high done")
            h = job(c, high)
            assert h["priority"] == 10 and h["steps_lost"] == 0
            assert told(c, high)[-1] == "admitted on 2 workers (min 2, priority 10)"

            lo_ = wait_for(lambda: (x := job(c, low))["world_size"] == 4 and x["reconfigurations"].get("grow")
                           and x, timeout=30, what="low grown back")
            assert f"shrunk 4→2 to admit job {high} (priority 10)" in told(c, low)
            assert any(r.startswith("grown 2→4") for r in told(c, low))
            assert lo_["reconfigurations"]["planned"] >= 2 and lo_["steps_lost"] == 0  # start + shrink, no redo
            done = wait_for(lambda: (x := job(c, low))["state"] == "SUCCEEDED" and x, timeout=30, what="low done")
            assert done["steps_lost"] == 0
            assert [m["step"] for m in c.get(f"{J}/{low}/metrics").json()] == list(range(1, 151))
    finally:
        stop_all(launcher)


def test_a_job_that_does_not_fit_is_queued_with_its_place_and_why_and_a_lower_one_is_paused_for_a_higher(tmp_path):
    launcher, _ = make_launcher({"a": 2}, step_s=0.02)
    try:
        with TestClient(make_app(tmp_path, launcher, schedule=True)) as c:
            first = c.post(J, json={"spec": spec("first", lo=2, hi=2, steps=400)}).json()["id"]
            wait_for(lambda: job(c, first)["state"] == "RUNNING", what="first running")
            second = c.post(J, json={"spec": spec("second", lo=2, hi=2, steps=5)}).json()["id"]
            q = wait_for(lambda: (x := job(c, second))["queue_position"] == 1 and x, what="second queued")
            assert q["state"] == "QUEUED" and "needs 2 workers" in q["reason"] and q["held"] == {}
            listed = {j["id"]: j for j in c.get(J).json()}
            assert listed[second]["queue_position"] == 1 and listed[first]["held"] == {"a": 2}

            # a higher priority: shrinking cannot free 2 workers (first is at its minimum): first is paused,
            # checkpoint first, and resumed once the urgent job is done; the equal-priority second waits on
            urgent = c.post(J, json={"spec": spec("urgent", lo=2, hi=2, priority=5, steps=5)}).json()["id"]
            p = wait_for(lambda: (x := job(c, first))["state"] == "PAUSED" and x, what="first paused")
            assert p["cause"] == "scheduler" and p["reason"].endswith(f"to admit job {urgent} (priority 5)")
            assert p["committed_step"] == p["step"]  # checkpoint first: 0 steps lost
            wait_for(lambda: job(c, urgent)["state"] == "SUCCEEDED", timeout=30, what="urgent done")
            r = wait_for(lambda: (x := job(c, first))["state"] == "RUNNING" and x, timeout=30, what="first back")
            assert r["steps_lost"] == 0 and job(c, second)["state"] == "QUEUED"
            c.post(f"{J}/{first}/stop")
            wait_for(lambda: job(c, second)["state"] == "SUCCEEDED", timeout=30, what="second ran once first stopped")
    finally:
        stop_all(launcher)


def test_quotas_hold_per_user_and_are_shown(tmp_path):
    launcher, _ = make_launcher({"a": 4}, step_s=0.02)
    users = {"ann": "ann-token", "bob": "bob-token"}
    try:
        with TestClient(make_app(tmp_path, launcher, schedule=True, token="admin", user_tokens=users,
                                 quotas={"ann": Quota(max_workers=2, max_jobs=1)})) as c:
            ann = {"Authorization": "Bearer ann-token"}
            one = c.post(J, json={"spec": spec("one", lo=1, hi=4, steps=300)}, headers=ann).json()["id"]
            wait_for(lambda: c.get(f"{J}/{one}", headers=ann).json()["world_size"] == 2, what="ann's job at 2")
            two = c.post(J, json={"spec": spec("two", lo=1, hi=1, steps=5)}, headers=ann).json()["id"]
            q = wait_for(lambda: (x := c.get(f"{J}/{two}", headers=ann).json())["state"] == "QUEUED"
                         and x["queue_position"] and x, what="ann's second job queued")
            assert "quota" in q["reason"]
            assert c.get("/api/v1/quotas", headers=ann).json() == [
                {"owner": "ann", "max_workers": 2, "max_jobs": 1, "workers_held": 2, "jobs_running": 1}]
            admin = c.get("/api/v1/quotas", headers={"Authorization": "Bearer admin"}).json()
            assert [u["owner"] for u in admin] == ["ann"]
            c.post(f"{J}/{one}/stop", headers=ann)
            wait_for(lambda: c.get(f"{J}/{two}", headers=ann).json()["state"] == "SUCCEEDED", timeout=30,
                     what="the second job once the first stopped")
    finally:
        stop_all(launcher)


def test_a_job_its_owners_quota_could_never_run_is_refused_at_submit_with_the_numbers(tmp_path):
    launcher, _ = make_launcher({"a": 4}, step_s=0.02)
    try:
        with TestClient(make_app(tmp_path, launcher, schedule=True, token="admin", user_tokens={"ann": "ann-token"},
                                 quotas={"ann": Quota(max_workers=2)})) as c:
            r = c.post(J, json={"spec": spec("big", lo=3, hi=4)}, headers={"Authorization": "Bearer ann-token"})
            assert r.status_code == 422, r.text
            [err] = r.json()["detail"]
            assert err["loc"] == ["body", "spec", "parallel", "min_workers"]
            assert err["msg"] == ("min_workers=3, but owner ann's quota allows 2 workers, so the job could never "
                                  "start: ask for at most 2 workers, or a larger quota")
            assert c.get(J, headers={"Authorization": "Bearer admin"}).json() == []  # nothing recorded
    finally:
        stop_all(launcher)


def test_a_job_the_whole_cluster_cannot_fit_is_queued_with_its_place_and_the_schedulers_reason(tmp_path):
    launcher, _ = make_launcher({"a": 2, "b": 2}, step_s=0.02)
    try:
        with TestClient(make_app(tmp_path, launcher, schedule=True)) as c:
            big = c.post(J, json={"spec": spec("big", lo=6, hi=8)}).json()["id"]
            q = wait_for(lambda: (x := job(c, big))["queue_position"] and x, what="queued with a place")
            assert q["state"] == "QUEUED" and q["queue_position"] == 1
            assert q["reason"] == "needs 6 workers of 1 CPU; the whole cluster fits 4"
    finally:
        stop_all(launcher)


def test_a_submit_answers_without_waiting_for_the_scheduling_round(tmp_path):
    # the round tells coordinators their grants; a coordinator slow to answer must not hold up POST /jobs
    launcher, _ = make_launcher({"a": 2}, step_s=0.02)
    slow = threading.Event()
    launch = launcher.launch

    def launch_slow(job, **kw):
        runner = launch(job, **kw)
        send = runner.send
        runner.send = lambda cmd: (slow.wait(30), send(cmd))[1]
        return runner

    launcher.launch = launch_slow
    answered: list = []
    try:
        with TestClient(make_app(tmp_path, launcher, schedule=True)) as c:
            t = threading.Thread(target=lambda: answered.append(c.post(J, json={"spec": spec("one", lo=1, hi=2)})))
            t.start()
            t.join(10)
            assert answered and answered[0].status_code == 201, "POST /jobs waited for the coordinator's grant"
            slow.set()
            wait_for(lambda: job(c, answered[0].json()["id"])["state"] == "RUNNING", what="started once told")
            c.post(f"{J}/{answered[0].json()['id']}/stop")
    finally:
        slow.set()
        stop_all(launcher)
