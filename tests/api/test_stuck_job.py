"""Issue 29 item 5: one user's stuck job does not block everyone's reads. Its coordinator answers nothing
(every call waits until the test lets it go); 60 commands sent to it at once must not take the request
threads that another user's reads need."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi.testclient import TestClient

from service.control.status import JobStatus
from tests.api.helpers import HandleLauncher, SPEC, make_app

J = "/api/v1/jobs"
ALICE, BOB = {"Authorization": "Bearer al1ce"}, {"Authorization": "Bearer b0b"}


class Handle:
    def __init__(self, stuck: threading.Event | None):
        self.stuck = stuck

    def _wait(self):
        if self.stuck is not None:
            self.stuck.wait(60)

    def status(self):
        self._wait()
        return JobStatus(state="RUNNING", reason="", step=1, total_steps=10, world_size=1)

    def events_since(self, index=0):
        return []

    def metrics_since(self, step=0):
        return []

    def send(self, cmd):
        self._wait()


def stuck_launcher(stuck: threading.Event) -> HandleLauncher:
    """Coordinators that are stuck (answer nothing until `stuck` is set) for jobs named "stuck"."""
    return HandleLauncher(lambda job: Handle(stuck if job.cfg.name == "stuck" else None))


def test_reads_answer_while_a_stuck_job_has_60_commands_waiting(tmp_path):
    stuck = threading.Event()  # set: the stuck coordinator answers again
    app = make_app(tmp_path, stuck_launcher(stuck), token="adm1n", user_tokens={"alice": "al1ce", "bob": "b0b"})
    with TestClient(app) as c:
        bobs = c.post(J, json={"spec": {**SPEC, "name": "stuck"}}, headers=BOB).json()["id"]
        alices = c.post(J, json={"spec": SPEC}, headers=ALICE).json()["id"]
        sent = time.monotonic()
        with ThreadPoolExecutor(61) as pool:
            resizes = [pool.submit(c.post, f"{J}/{bobs}/resize", json={"workers": 1}, headers=BOB) for _ in range(60)]
            time.sleep(0.5)  # every resize has reached the server

            def read_20() -> list[float]:
                out = []
                for _ in range(20):
                    t0 = time.monotonic()
                    r = c.get(f"{J}/{alices}", headers=ALICE)
                    out.append(time.monotonic() - t0)
                    assert r.status_code == 200 and r.json()["id"] == alices
                return out

            reading = pool.submit(read_20)
            try:
                reads = reading.result(timeout=10)  # the stuck job would hold them for minutes
            finally:
                answered = [f.result().status_code for f in resizes if f.done()]
                waited = time.monotonic() - sent
                stuck.set()  # let everything unwind, whatever happened
            codes = sorted(f.result().status_code for f in resizes)
    print(f"read latency with 60 commands to a stuck job: median {sorted(reads)[10] * 1000:.1f} ms, "
          f"max {max(reads) * 1000:.1f} ms; {len(answered)} of 60 commands answered before it was released")
    assert waited < 30 and max(reads) < 2.0  # the stuck job would have held them for up to 60 s
    # all but the one waiting for the job's lock (and one that got through): 503 from the one-command guard,
    # or 429 beyond bob's requests answered at once (api.app.PerUserLimit)
    assert answered.count(503) + answered.count(429) >= 58
    assert set(codes) <= {202, 429, 503} and codes.count(503) + codes.count(429) >= 58
