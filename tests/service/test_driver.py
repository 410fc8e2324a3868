"""JobRunner, the coordinator's thread under `elastron run`: Ctrl-C interrupts its join, and what comes
after must still wait for the loop (a loop still calling Ray after `ray.shutdown()` aborts the process)."""

from __future__ import annotations

import signal
import threading
import time

from service.control.job import Job
from service.server.driver import JobRunner
from workers.config import JobConfig


class SlowToHalt:
    """A coordinator whose loop runs until halted, then takes a moment to release its workers."""

    def __init__(self, job, *, options):
        self.halted, self.released = threading.Event(), threading.Event()
        self.watcher = type("W", (), {"stop": lambda self: None})()

    def run(self, on_tick=None):
        self.halted.wait(30)
        time.sleep(0.5)  # releasing the group
        self.released.set()

    def halt(self):
        self.halted.set()


def test_abandon_after_an_interrupted_join_waits_for_the_loop_to_end(tmp_path):
    runner = JobRunner(Job.of(JobConfig(), job_id="j", run_dir=tmp_path), coordinator_factory=SlowToHalt)
    main = threading.main_thread().ident
    # Python's own Ctrl-C handler, whatever this suite inherited (started in the background, SIGINT is ignored)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT)).start()  # Ctrl-C during the join
        runner.join()
        raise AssertionError("the join was not interrupted")
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, before)
    assert not runner.join(timeout=0)  # an interrupted join does not count the loop as ended
    runner.abandon(timeout_s=10)
    assert runner.coord.released.is_set()  # abandon returned only once the loop had released its workers
    assert runner.join(timeout=0)
