"""The job API as `elastron serve` runs it, with coordinator timings for a chaos run (1 s growth settle,
short training chunks, fast cluster polling) instead of the production defaults.

    python benchmarks/chaos_server.py --address RAY --port P --runs-root DIR --store URL

Same app, store, job manager and Ray launcher (coordinators as named detached actors) as the real
server: killing and restarting this process is the "API server restart" fault.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

COORDINATOR_OPTIONS = {"settle_seconds": 1.0, "chunk_seconds": 0.2, "poll_interval_s": 0.2,
                       "start_timeout_s": 60.0, "max_restarts": 20}
"""max_restarts: each failure kind may recur this often within the window; a chaos run injects many."""


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from api.app import create_app
    from api.deps import Settings
    from api.run import connect_ray
    from api.store import JobStore
    from service.server.job_actor import RayLauncher
    from service.server.job_manager import JobManager

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--runs-root", required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--coordinator-restarts", type=int, default=None,
                    help="how often Ray restarts a job's coordinator actor (-1: always); default as "
                         "`elastron serve` (service.server.job_actor.MAX_RESTARTS)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    connect_ray(a.address)
    settings = Settings(runs_root=Path(a.runs_root), store_url=a.store, sync_interval_s=0.2)
    restarts = {} if a.coordinator_restarts is None else {"max_restarts": a.coordinator_restarts}
    jobs = JobManager(JobStore(settings.store_url), RayLauncher(options=COORDINATOR_OPTIONS, timeout_s=30, **restarts),
                      runs_root=settings.runs_root, sync_interval_s=settings.sync_interval_s,
                      stop_timeout_s=settings.stop_timeout_s)
    uvicorn.run(create_app(jobs=jobs, settings=settings), host="127.0.0.1", port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
