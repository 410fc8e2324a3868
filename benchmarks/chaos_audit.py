"""Watches a job's checkpoint directory during a chaos run and checks the two checkpoint promises:

  * no committed checkpoint is lost: a committed step directory only ever disappears when at least
    `keep_last` newer committed ones exist (retention);
  * nothing uncommitted is loaded: every step a new worker group resumed from had been committed
    (its step directory, which only a commit creates, was seen) before that resume.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointAudit:
    def __init__(self, ckpt_dir: Path, keep_last: int, interval_s: float = 0.02):
        self.dir, self.keep_last, self.interval_s = Path(ckpt_dir), keep_last, interval_s
        self.first_seen: dict[int, float] = {}
        self.problems: list[str] = []
        self._now: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ckpt-audit", daemon=True)

    def start(self) -> "CheckpointAudit":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.poll()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def committed(self) -> set[int]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return set()
        return {int(m.group(1)) for n in names if (m := STEP_DIR.match(n))}

    def poll(self) -> None:
        now, t = self.committed(), time.time()
        for s in now - self._now:
            self.first_seen.setdefault(s, t)
        gone = self._now - now
        if gone:
            newer = sorted(now | self._now, reverse=True)[:self.keep_last]
            for s in sorted(gone):
                if s >= min(newer):
                    self.problems.append(f"committed checkpoint step {s} disappeared while it was among the "
                                         f"newest {self.keep_last} ({sorted(newer)})")
        self._now = now

    def check_resumes(self, resumes: list[tuple[int, float]]) -> None:
        """`resumes`: (resumed step, unix time of the resume) from the job's resize events."""
        for step, t in resumes:
            if step == 0:
                continue
            seen = self.first_seen.get(step)
            if seen is None or seen > t:
                self.problems.append(f"a group resumed from step {step} at {t:.3f}, but no committed checkpoint of "
                                     f"that step was seen before then (first seen: {seen})")
