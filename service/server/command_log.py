"""The user's commands to a job, kept in RUN_DIR/commands.jsonl so that a restarted coordinator (Ray
restarts a job actor whose process died) knows what the user asked: a paused job stays paused, a
stopped one stops, a resize holds. One JSON line per command a coordinator accepted
(service.control.commands.to_json), written (and fsynced) before the caller is answered; a restarted
JobRunner replays this job's commands in order, before its loop starts (resizes compose, SetWorkers; the
last of pause/resume/stop wins; the last grant of the shared-cluster scheduler holds).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from service.control.commands import Command, CommandError, from_json, to_json

logger = logging.getLogger(__name__)


class CommandLog:
    def __init__(self, path: Path, job_id: str):
        self.path, self.job_id = Path(path), job_id

    def append(self, cmd: Command) -> None:
        line = json.dumps({"time": time.time(), "job_id": self.job_id, **to_json(cmd)})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def commands(self) -> list[Command]:
        """This job's commands, oldest first (other jobs' lines, a torn last line and a line that is no
        command are skipped)."""
        try:
            lines = self.path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return []
        out = []
        for line in lines:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if not isinstance(d, dict) or d.get("job_id") != self.job_id:
                continue
            try:
                out.append(from_json(d))
            except CommandError as e:
                logger.warning("job %s: %s in %s skipped: %s", self.job_id, line[:200], self.path, e)
        return out
