"""Where a job's training stands: the bookkeeping the coordinator's handlers share.

`Progress` keeps the last step done, the last committed checkpoint's step, the recent metrics rows and
the reconfiguration records, and takes in what each kind of call brings back: the rows of a training
chunk (`trained`), the rows a salvage or a takeover recovered from workers (`recovered`), the first
step at a new layout (`closed`). Its readers (the coordinator's `status`, `metrics_since`) take the same
lock its writers do, so a status never shows a step whose metrics are not in yet.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from service.control.metrics_ring import RecentMetrics
from service.control.reconfiguration import Live, Reconfig, Reconfigs, TransferPath
from service.control.run_files import last_logged_step
from workers.report import StepMetrics, Trained


class Progress:
    def __init__(self, lock: threading.RLock | None = None, *, run_dir: Path | None = None):
        self.lock = lock if lock is not None else threading.RLock()
        self.run_dir = run_dir
        """Where rank 0 logs each step's row (RUN_DIR/metrics.jsonl); `recovered` adds the rows it never logged."""
        self.step_done = 0
        """The last step every rank finished (as rank 0's metrics say)."""
        self.committed_step = 0
        """The step of the last committed durable checkpoint."""
        self.metrics: dict[int, StepMetrics] = RecentMetrics()  # bounded: the store and metrics.jsonl keep the rest
        self.reconfigs = Reconfigs()  # bounded: events.jsonl keeps every resize

    def trained(self, trained: Trained) -> tuple[StepMetrics, ...]:
        """What rank 0 trained in a chunk: its rows, oldest first, are the steps done now. Returns them."""
        rows = trained.rows
        with self.lock:
            for m in rows:
                self.metrics[m.step] = m
            if rows:
                self.step_done = rows[-1].step
                self.committed_step = max(self.committed_step, trained.committed_step)
        return rows

    def recovered(self, rows: Iterable[StepMetrics], *, at: int | None = None, committed: int = 0) -> None:
        """Rows of steps the workers finished that the coordinator never read (a salvage's, a takeover's):
        kept where no row of that step is. `at`: the step the state they keep is at (the job's step
        from now on); None: the latest of the rows and the step already done."""
        rows = tuple(rows)
        with self.lock:
            for r in rows:
                self.metrics.setdefault(r.step, r)
            self.step_done = at if at is not None else max([self.step_done, *(r.step for r in rows)])
            self.committed_step = max(self.committed_step, committed)
            self._log_unlogged(rows)

    def _log_unlogged(self, rows: tuple[StepMetrics, ...]) -> None:
        """Append to RUN_DIR/metrics.jsonl the recovered rows past its last line, up to the step the job
        is at: a step the survivors finished whose rank 0 died before logging it (its state is kept, so
        its row must be too). The group that trains on logs from the next step."""
        if self.run_dir is None or not rows:
            return
        last = last_logged_step(self.run_dir)
        missing = [r for r in rows if last < r.step <= self.step_done]
        if missing:  # as rank 0 writes a row: without what the step's snapshot and set-up cost
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write("".join(replace(r, snapshot=None, set_up_after=None).to_json() + "\n" for r in missing))

    def closed(self, record: Reconfig, first: StepMetrics) -> Reconfig:
        """The first step at the layout `record` formed has run (its row `first`): the record, complete, is
        kept and returned."""
        with self.lock:
            done = record.first_step(first, self.metrics.get(record.step_before))
            self.reconfigs.append(done)
        return done

    def last_move_off_s(self) -> float | None:
        """Seconds the newest live move of a sound group needed its old workers (its hand-over and
        transfer: a drain's move off a node), None before one is recorded."""
        with self.lock:
            for r in reversed(self.reconfigs):
                if isinstance(r.transfer, Live) and r.transfer.path is TransferPath.LIVE:
                    return r.transfer.moved.handover_s + r.transfer.moved.transfer_s
        return None

    def steps_per_call(self, chunk_seconds: float) -> int:
        """As many steps as fit in `chunk_seconds` at the last measured step time (1 until measured)."""
        last = self.metrics.get(self.step_done)
        step_time = last.step_time if last else None
        if not step_time:
            return 1
        return max(1, min(100, int(chunk_seconds / step_time)))
