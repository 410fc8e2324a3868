"""`elastron run`: one job through the coordinator, on a Ray cluster at an address or a local one."""

from __future__ import annotations

import json
import os
from pathlib import Path

from api.progress import Progress, reconfig_table


def connect_ray(address: str | None, *, num_cpus: int | None = None) -> None:
    """Attach to `address`, or to the cluster `ray job submit` put us in (RAY_ADDRESS), or start a
    private local Ray (never a stale session left in /tmp/ray)."""
    import ray

    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=False)
    elif os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 log_to_driver=False)


def run_job(config: str, *, address: str | None = None, workers: int | None = None, layout: str | None = None,
            steps: int | None = None, run_dir: str | None = None, settle_seconds: float = 10.0,
            json_path: str | None = None) -> int:
    from service.coordinator import Coordinator, CoordinatorOptions
    from workers.config import load_config

    cfg = load_config(config)
    if workers is not None and layout is not None:
        raise ValueError("give --workers or --layout, not both")
    if steps is not None and steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    rd = Path(run_dir or Path("runs") / cfg.name)
    try:
        connect_ray(address)
    except Exception as e:  # ConnectionError, TimeoutError, RuntimeError from ray.init
        raise RuntimeError(f"cannot connect to Ray at {address or os.environ.get('RAY_ADDRESS')}: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    coord = Coordinator(cfg, run_dir=rd, total_steps=steps, workers=workers, layout=layout,
                        options=CoordinatorOptions(settle_seconds=settle_seconds))
    print(f"elastron run: job {coord.job_id} ({cfg.name}), {coord.total_steps} steps, run dir {rd}", flush=True)
    progress = Progress(coord.total_steps)
    state = coord.run(on_tick=lambda c: progress.update(c.status()))
    progress.close()
    return summarize(coord, json_path)


def summarize(coord, json_path: str | None) -> int:
    st = coord.status()
    recs = [r.to_dict() for r in coord.reconfigs]
    print(f"\njob {coord.job_id}: {st['state']} at step {st['step']}/{coord.total_steps}"
          + (f", loss {st['loss']:.4f}" if st.get("loss") is not None else "")
          + (f" — {st['reason']}" if st["state"] != "SUCCEEDED" else ""))
    if recs:
        print(reconfig_table(recs))
    if json_path:
        Path(json_path).write_text(json.dumps({"status": st, "reconfigs": recs}, indent=2, default=str))
    return 0 if st["state"] == "SUCCEEDED" else 1
