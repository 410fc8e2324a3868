"""`elastron run`: one job through the coordinator, on a Ray cluster at an address or a local one."""

from __future__ import annotations

import json
import os
import sys
import socket
from pathlib import Path

from api.progress import Progress, reconfig_table

RAY_CONNECT_TIMEOUT_S = 10.0
"""How long the address of a Ray cluster may take to accept a connection (ELASTRON_RAY_CONNECT_TIMEOUT_S)."""

RAY_CONNECT_ATTEMPTS = "3"
"""Attempts ray.init makes to reach a GCS at an address that accepts connections (Ray's own default is 20,
about 40 s each when what listens there is not a GCS); RAY_gcs_server_port_wait_time_s overrides it."""


def probe_address(address: str, timeout_s: float | None = None) -> None:
    """Raise ConnectionError unless something accepts a TCP connection at `address` ("host:port" or
    "ray://host:port") within `timeout_s`: ray.init retries an address that does not answer for
    minutes. Other forms ("auto", ...) are left to Ray."""
    if timeout_s is None:
        timeout_s = float(os.environ.get("ELASTRON_RAY_CONNECT_TIMEOUT_S", RAY_CONNECT_TIMEOUT_S))
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or "://" in hostport or "/" in hostport:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        why = f"no answer within {timeout_s:g} s" if isinstance(e, TimeoutError) else e.strerror or str(e)
        raise ConnectionError(f"nothing answers there ({why}); start the Ray head (`ray start --head` prints "
                              "its address) or fix the address") from None


def connect_ray(address: str | None, *, num_cpus: int | None = None) -> None:
    """Attach to `address`, or to the cluster `ray job submit` put us in (RAY_ADDRESS), or start a
    private local Ray (never a stale session left in /tmp/ray). An address that does not answer fails
    within ELASTRON_RAY_CONNECT_TIMEOUT_S (see probe_address)."""
    import ray

    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS")
    if target:
        probe_address(target)
        bounded = "RAY_gcs_server_port_wait_time_s" not in os.environ
        if bounded:  # read by ray.init only while it connects to the GCS (ray/_private/node.py)
            os.environ["RAY_gcs_server_port_wait_time_s"] = RAY_CONNECT_ATTEMPTS
        try:
            ray.init(address=address, log_to_driver=False) if address else ray.init(log_to_driver=False)
        finally:
            if bounded:
                os.environ.pop("RAY_gcs_server_port_wait_time_s", None)
    else:
        ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=False,
                 log_to_driver=False)


def run_job(config: str, *, address: str | None = None, workers: int | None = None, layout: str | None = None,
            steps: int | None = None, run_dir: str | None = None, settle_seconds: float = 10.0,
            json_path: str | None = None) -> int:
    import gc
    import uuid

    # a Ray call after this process's Ray is shut down (a thread still ending at Ctrl-C) must fail, never
    # start or join another cluster: read when ray is first imported
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    from service.server.driver import JobRunner, load_job

    # The spec is parsed here, once, and checked before Ray starts; the coordinator and workers get its job.
    job, warnings = load_job(config, job_id=uuid.uuid4().hex[:12], workers=workers, layout=layout, steps=steps,
                             run_dir=run_dir)
    for w in warnings:
        print(f"elastron run: warning: {w}", file=sys.stderr, flush=True)
    try:
        connect_ray(address)
    except Exception as e:  # ConnectionError, TimeoutError, RuntimeError from ray.init
        where = address or os.environ.get("RAY_ADDRESS") or "a new local Ray"
        raise RuntimeError(f"cannot connect to Ray at {where}: "
                           f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    print(f"elastron run: job {job.id} ({job.cfg.name}), {job.total_steps} steps, run dir {job.run_dir}", flush=True)
    progress = Progress(job.total_steps)
    runner = JobRunner(job, options={"settle_seconds": settle_seconds}, on_tick=lambda c: progress.update(c.status()))
    try:
        runner.join()
    except KeyboardInterrupt:  # Ctrl-C reaches Ray's workers too: they are gone; say where the job stands, once
        import ray

        progress.close()
        runner.abandon()
        st = runner.status()
        print(f"elastron run: interrupted: job {job.id} stopped at step {st.step}; its last checkpoint is step "
              f"{st.committed_step}, from which the same command resumes", file=sys.stderr, flush=True)
        gc.collect()  # free what still refers to Ray objects while Ray is up: freed after shutdown, they abort
        ray.shutdown()
        return 130
    progress.close()
    return summarize(runner, json_path)


def summarize(runner, json_path: str | None) -> int:
    st = runner.status()
    recs = runner.reconfigs()
    print(f"\njob {runner.job_id}: {st.state} at step {st.step}/{st.total_steps}"
          + (f", loss {st.loss:.4f}" if st.loss is not None else "")
          + (f" — {st.reason}" if st.state != "SUCCEEDED" else ""))
    if recs:
        print(reconfig_table(recs))
    if json_path:
        Path(json_path).write_text(json.dumps({"status": st.to_dict(), "reconfigs": recs}, indent=2, default=str))
    return 0 if st.state == "SUCCEEDED" else 1
