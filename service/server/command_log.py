"""The user's commands to a job, kept in RUN_DIR/commands.jsonl so that a restarted coordinator (Ray
restarts a job actor whose process died) knows what the user asked: a paused job stays paused, a
stopped one stops, a resize holds. One JSON line per command a coordinator accepted, written (and
fsynced) before the caller is answered; a restarted JobRunner replays this job's lines in order, before
its loop starts (resizes compose, service.control.commands.SetWorkers; the last of pause/resume/stop wins; the
last grant of the shared-cluster scheduler holds).
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

COMMANDS = ("resize", "pause", "resume", "stop", "set_grant")


class CommandLog:
    def __init__(self, path: Path, job_id: str):
        self.path, self.job_id = Path(path), job_id

    def append(self, command: str, **args) -> None:
        if command not in COMMANDS:
            raise ValueError(f"unknown command {command!r}")
        line = json.dumps({"time": time.time(), "job_id": self.job_id, "command": command,
                           "args": {k: v for k, v in args.items() if v is not None}})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def commands(self) -> list[tuple[str, dict]]:
        """This job's commands, oldest first (other jobs' lines and a torn last line are skipped)."""
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
            if (isinstance(d, dict) and d.get("job_id") == self.job_id and d.get("command") in COMMANDS
                    and isinstance(d.get("args", {}), dict)):
                out.append((d["command"], d.get("args", {})))
        return out
