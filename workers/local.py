"""Launch N ranks of `workers.train` on this machine (a torchrun stand-in with no extra dependency).

Each rank is a subprocess with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, so the ranks run exactly the
torchrun contract. Rank 0's output is streamed; if any rank fails, the others are stopped.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from workers.runtime import free_port


def launch_local(
    config_path: str | Path,
    *,
    nproc: int,
    run_dir: str | Path,
    layout: str | None = None,
    steps: int | None = None,
    on_line: Callable[[str], None] = lambda line: print(line, end="", flush=True),
) -> int:
    """Run `nproc` ranks to completion; return the first non-zero exit code (0 on success)."""
    port = free_port()
    cmd = [sys.executable, "-m", "workers.train", str(config_path), "--run-dir", str(run_dir)]
    if layout:
        cmd += ["--layout", layout]
    if steps is not None:
        cmd += ["--steps", str(steps)]
    threads = max(1, (os.cpu_count() or 1) // nproc)
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        # Rank 0 speaks for the job; the others only report errors (on their stderr, passed through).
        procs.append(subprocess.Popen(cmd, env=env, text=True,
                                      stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL))
    reader = threading.Thread(target=lambda: [on_line(line) for line in procs[0].stdout], daemon=True)
    reader.start()
    try:
        # A failed rank leaves the others blocked in a collective: stop them all at the first failure.
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.05)
        reader.join(timeout=5)
        return failed[0] if failed else 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
