"""What the coordinator and its parts share: the job's settings, its event log and progress, node
health, and the resources it holds across states.

The coordinator (service.control.coordinator) keeps the state machine and composes three parts, one
concept each: carrying out a reconfiguration (service.control.reconfigure), recovering after a failure
(service.control.recovery) and taking over after a restart (service.control.takeover). Each is given
this context instead of the coordinator: the worker group and the plan it runs are the only things
they change besides the event log, the progress and the failure ledger, and they change them here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from parallel.planner import Plan
from service.control.options import CoordinatorOptions
from service.control.policy import Failure
from service.control.progress import Progress
from service.control.state import StateMachine
from service.pool.cluster import ClusterWatcher
from service.pool.group import Group
from service.pool.node_health import NodeHealth
from workers.config import JobConfig


@dataclass(kw_only=True, slots=True, eq=False)
class Context:
    cfg: JobConfig
    opts: CoordinatorOptions
    sm: StateMachine
    """Transitions and notes: every event the job's parts emit."""
    progress: Progress
    health: NodeHealth
    watcher: ClusterWatcher
    new_group: Callable[[], Group]
    """Makes an empty worker group (the coordinator's `worker_group_cls` seam, read when called)."""
    lock: threading.RLock = field(default_factory=threading.RLock)
    """Taken by whoever changes what `status` reads together (the group's plan and the step)."""
    failures: list[Failure] = field(default_factory=list)
    """The failures within the policy's restart window (and final ones): its retry budget reads them."""
    group: Group | None = None
    """The workers the job holds: members, and their spares and standbys."""
    plan: Plan | None = None
    """The plan the group was formed for (kept through a failure: what a salvage checks against)."""

    def shutdown_group(self) -> None:
        """Stop every worker the job holds."""
        if self.group is not None:
            self.group.shutdown()
            self.group = None
