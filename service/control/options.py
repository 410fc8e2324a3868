"""How a coordinator behaves in time: intervals, timeouts and retry budgets (all seams for tests)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class CoordinatorOptions:
    settle_seconds: float = 10.0
    """Capacity must be stable this long before the job grows onto it."""
    chunk_seconds: float = 0.5
    """Target length of one training call between two looks at the cluster (steps per call are set
    from the measured step time, the same count on every rank)."""
    poll_interval_s: float = 0.5
    """Cluster watcher interval."""
    max_restarts: int = 3
    """Failures of one kind tolerated within restart_window_s before the job fails."""
    restart_window_s: float = 600.0
    start_timeout_s: float = 30.0
    """How long placing new workers may take before it counts as a failure."""
    include_head: bool = True
    """Whether workers may run on the Ray head node."""
    probe_timeout_s: float = 2.0
    """After a failure, a node that cannot place a tiny bundle within this long is left out of plans."""
    suspect_seconds: float = 60.0
    """How long such a node stays out (unless Ray confirms it dead first, or a later probe reaches it)."""
    reprobe_interval_s: float = 3.0
    """While the job waits or starts with suspects left out, how often they are probed again; and how long
    a start waits for its workers before it probes the nodes they are still starting on (and as often)."""
    owner: str | None = None
    """The named Ray actor this coordinator runs in (service.server.job_actor sets it), in `namespace`. When set,
    workers are detached actors that outlive a restart of it: the restarted coordinator takes them over
    (their group trains on, or heals from their state) instead of restarting every rank, and they end
    themselves once the actor is gone for good. None (`elastron run`, the demo): workers end with the
    coordinator's process."""
    namespace: str = "elastron"
