"""Where the REST API's jobs run: launchers that start, find and release a job's driver.

The driver is `service.server.driver.JobRunner` (a Coordinator in a background thread), the same one that
`elastron run` and `elastron demo` use. `LocalLauncher` runs it in this process (the API's tests);
`job_actor_class()` turns the very same class into the Ray actor that `RayLauncher` starts as
``elastron-job-{id}`` in namespace ``elastron`` with ``lifetime="detached"``, so the job outlives the
API server that submitted it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any


from service.control.commands import Command, CommandError, Stop
from service.server.command_log import CommandLog
from service.control.coordinator import Coordinator
from service.control.job import Job
from service.server.driver import CoordinatorFactory, JobRunner
from service.control.status import JobStatus

logger = logging.getLogger(__name__)

NAMESPACE = "elastron"
"""Ray namespace of the job actors (so `ray.get_actor(name, namespace=NAMESPACE)` finds them)."""

def actor_name(job_id: str) -> str:
    return f"elastron-job-{job_id}"


class JobActorBody(JobRunner):
    """A REST job's runner: a JobRunner whose commands are logged in RUN_DIR/commands.jsonl once the
    coordinator accepted them, and replayed into a restarted coordinator before its loop starts
    (service.server.command_log): a paused job stays paused across a Ray restart of its actor, a stopped one
    stops, a resize holds."""

    def __init__(self, job: Job, *, coordinator_factory: CoordinatorFactory | None = None,
                 grant: dict[str, int] | None = None, **kw):
        """`grant`: the shared-cluster scheduler's first grant ({} for a job that starts QUEUED; None: no
        scheduler), set before the loop starts so that the job never plans onto the whole cluster."""
        log = CommandLog(job.run_dir / "commands.jsonl", job.id)
        base = coordinator_factory or Coordinator

        def factory(*a, **k):  # JobRunner builds the coordinator, then starts its loop: replay between
            coord = base(*a, **k)
            if grant is not None:
                coord.grant = dict(grant)
            for cmd in log.commands():
                try:
                    coord.send(cmd)
                except CommandError as e:  # e.g. a resize the spec no longer allows
                    logger.warning("job %s: logged command %s not replayed: %s", job.id, cmd, e)
            return coord

        self.commands = log
        super().__init__(job, coordinator_factory=factory, **kw)

    def send(self, cmd: Command) -> None:
        super().send(cmd)
        self.commands.append(cmd)


_actor_cls = None

MAX_RESTARTS = 1000
"""How often, over the job's whole life, Ray restarts a job's coordinator actor whose process died. A
restarted coordinator finds the job's events in the run directory, takes over the workers the old one
left running (detached actors), whose group trains on or heals from their state; what it cannot take
over resumes from the last committed checkpoint. What ends a crash loop is the job's own budget, as for
every failure kind: more than `max_restarts` restarts within `restart_window_s` fail the job (the
coordinator reads the earlier restarts back from the job's events). Ray's cap only bounds a loop that
dies before it can read them."""


def job_actor_class():
    """`JobActorBody` as a Ray actor class (made on first use so importing this module needs no Ray).
    Calls are not retried: a command sent to a dying coordinator fails, and the caller sees that."""
    global _actor_cls
    if _actor_cls is None:
        import ray

        _actor_cls = ray.remote(num_cpus=0, max_restarts=MAX_RESTARTS, max_task_retries=0)(JobActorBody)
    return _actor_cls


# -- launchers: how a JobManager starts, finds and releases job runners ------------------------------------

class JobGone(RuntimeError):
    """The job's coordinator no longer exists (actor dead or never started); its final state must come
    from what it wrote (the run directory's events.jsonl)."""


class JobUnavailable(RuntimeError):
    """The job's coordinator exists but did not answer in time (starting up, or busy); try again."""


class LocalLauncher:
    """Runs each job's `JobRunner` in this process. The runners live as long as this object, so a new
    JobManager given the same launcher re-attaches to them as it would to Ray's named actors (tests,
    and single-process use where the server's lifetime is the jobs' lifetime anyway)."""

    def __init__(self, *, coordinator_factory: CoordinatorFactory | None = None, options: dict | None = None,
                 cluster_fn: Callable[[], Any] | None = None):
        self.coordinator_factory = coordinator_factory
        self.options = dict(options or {})
        self.cluster_fn = cluster_fn
        self._runners: dict[str, JobRunner] = {}
        self._lock = threading.Lock()

    def launch(self, job: Job, *, grant: dict[str, int] | None = None) -> JobRunner:
        runner = JobActorBody(job, options=self.options, coordinator_factory=self.coordinator_factory, grant=grant)
        with self._lock:
            self._runners[job.id] = runner
        return runner

    def attach(self, job_id: str) -> JobRunner | None:
        with self._lock:
            return self._runners.get(job_id)

    def job_ids(self) -> list[str]:
        with self._lock:
            return list(self._runners)

    def gone(self, job_id: str) -> bool:
        """Runners live in this process only: one this launcher does not hold has ended for good."""
        with self._lock:
            return job_id not in self._runners

    def where(self) -> str:
        return "this process"

    def release(self, job_id: str, timeout_s: float = 10.0) -> None:
        with self._lock:
            runner = self._runners.pop(job_id, None)
        if runner is not None:
            runner.send(Stop())
            if not runner.join(timeout_s):
                logger.warning("job %s: coordinator thread still running %.0f s after stop; it is a daemon "
                               "thread and ends with the process", job_id, timeout_s)

    def cluster(self):
        return None if self.cluster_fn is None else self.cluster_fn()

    def in_use(self, snap) -> dict[str, tuple[float, float]] | None:
        """What is in use per node (None: unknown; the runners here use no Ray resources)."""
        return None


class RayHandle:
    """Calls on one job actor, with a timeout, turning Ray's errors into JobGone / JobUnavailable (and a
    ValueError raised by the coordinator back into a plain ValueError)."""

    def __init__(self, actor, job_id: str, timeout_s: float, namespace: str = NAMESPACE):
        self.actor, self.job_id, self.timeout_s, self.namespace = actor, job_id, timeout_s, namespace

    def _call(self, method: str, *args, **kwargs):
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

        try:
            return ray.get(getattr(self.actor, method).remote(*args, **kwargs), timeout=self.timeout_s)
        except RayTaskError as e:
            if isinstance(e.cause, CommandError):
                raise CommandError(e.cause.field, str(e.cause)) from None
            if isinstance(e.cause, ValueError):
                raise ValueError(str(e.cause)) from None
            raise JobUnavailable(f"job {self.job_id}: {method} failed in the coordinator: {e.cause!r}") from None
        except (GetTimeoutError, ActorUnavailableError):
            raise JobUnavailable(f"job {self.job_id}: coordinator actor {actor_name(self.job_id)} did not answer "
                                 f"{method} within {self.timeout_s:.0f} s") from None
        except RayActorError as e:
            if self._restarting():
                raise JobUnavailable(f"job {self.job_id}: coordinator actor {actor_name(self.job_id)} is "
                                     "restarting after its process died") from None
            raise JobGone(f"coordinator actor {actor_name(self.job_id)} died: "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def _restarting(self) -> bool:
        """Whether Ray is bringing the actor back: a named actor keeps its name while it restarts and
        loses it only once it is dead for good."""
        import ray

        try:
            ray.get_actor(actor_name(self.job_id), namespace=self.namespace)
        except ValueError:
            return False
        return True

    def status(self) -> JobStatus:
        return self._call("status")

    def events_since(self, index: int = 0) -> list[dict]:
        return self._call("events_since", index)

    def metrics_since(self, step: int = 0) -> list[dict]:
        return self._call("metrics_since", step)

    def send(self, cmd: Command) -> None:
        self._call("send", cmd)


STATE_API_RETRY_S = 60.0
"""After Ray's state API failed to answer, how long `RayLauncher.gone` waits before asking it again."""

HEAD_RESOURCE = "node:__internal_head__"
"""A resource only Ray's head node has (1.0 of it)."""


def _has_head() -> bool:
    import ray

    return any(n.get("Alive") and HEAD_RESOURCE in n.get("Resources", {}) for n in ray.nodes())


class RayLauncher:
    """Starts each job's runner as a named detached actor (``elastron-job-{id}`` in namespace ``elastron``,
    num_cpus=0), and finds it again by name after an API restart. Needs `ray.init` done by the caller.

    The actor is placed on the head node when there is one: not on a worker node that may be
    preempted, and next to the API as it is usually deployed, so the run directory it
    writes events.jsonl to is the one the API reads when the actor is gone. Detached actors outlive the
    API process only on a Ray cluster that outlives it (``ray start --head``, then ``--address``)."""

    def __init__(self, *, namespace: str = NAMESPACE, timeout_s: float = 10.0, options: dict | None = None,
                 pin_to_this_node: bool = True, coordinator_factory: CoordinatorFactory | None = None,
                 max_restarts: int = MAX_RESTARTS):
        self.namespace, self.timeout_s, self.options = namespace, timeout_s, dict(options or {})
        self.max_restarts = max_restarts
        self.pin_to_this_node = pin_to_this_node
        self.coordinator_factory = coordinator_factory
        self._state_api_retry_at: float | None = None
        """While Ray's state API is known not to answer (a Ray without a dashboard), `gone` does not ask
        before this monotonic time."""

    def launch(self, job: Job, *, grant: dict[str, int] | None = None) -> RayHandle:
        import ray

        job_id = job.id
        opts: dict[str, Any] = dict(name=actor_name(job_id), namespace=self.namespace, lifetime="detached",
                                    num_cpus=0, max_concurrency=4, max_restarts=self.max_restarts)
        if self.pin_to_this_node and _has_head():
            # The head holds the GCS, so it is never a spot instance and losing it ends the cluster anyway.
            # A resource only the head has, rather than soft node affinity: Ray 2.60 ignores soft
            # affinity for detached actors (measured: they land on any node).
            opts["resources"] = {HEAD_RESOURCE: 0.001}
        elif self.pin_to_this_node:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                         soft=True)
        # its workers outlive a restart of this actor, and end once it is gone for good
        owned = {**self.options, "owner": actor_name(job_id), "namespace": self.namespace}
        actor = job_actor_class().options(**opts).remote(job, options=owned, coordinator_factory=self.coordinator_factory,
                                                         grant=grant)
        return RayHandle(actor, job_id, self.timeout_s, self.namespace)

    def attach(self, job_id: str) -> RayHandle | None:
        import ray

        try:
            actor = ray.get_actor(actor_name(job_id), namespace=self.namespace)
        except ValueError:  # no live actor by that name
            return None
        return RayHandle(actor, job_id, self.timeout_s, self.namespace)

    def gone(self, job_id: str) -> bool:
        """Whether the Ray cluster this process is connected to knows the job's actor as DEAD (and not
        as alive or restarting). An actor it has never heard of is not gone: the job may run on another
        cluster. False when Ray's state API cannot answer (e.g. no dashboard): then it is asked again only
        after STATE_API_RETRY_S, and the traceback is logged once, not every sync round for every job."""
        now = time.monotonic()
        if self._state_api_retry_at is not None and now < self._state_api_retry_at:
            return False
        try:
            from ray.util.state import list_actors

            found = [a for a in list_actors(filters=[("name", "=", actor_name(job_id))], limit=100, timeout=10,
                                            raise_on_missing_output=False)
                     if getattr(a, "ray_namespace", self.namespace) == self.namespace]
        except Exception as e:
            first = self._state_api_retry_at is None
            self._state_api_retry_at = now + STATE_API_RETRY_S
            logger.warning("Ray's state API did not answer (%s); jobs whose coordinator is not found stay UNKNOWN, "
                           "not FAILED; asking again in %.0f s", type(e).__name__, STATE_API_RETRY_S, exc_info=first)
            return False
        self._state_api_retry_at = None
        return bool(found) and all(a.state == "DEAD" for a in found)

    def where(self) -> str:
        """The Ray cluster this process joined (its GCS address)."""
        try:
            import ray

            return f"the Ray cluster at {ray.get_runtime_context().gcs_address}"
        except Exception:
            return "a Ray cluster this process is not connected to"

    def release(self, job_id: str, timeout_s: float = 10.0) -> None:
        """End the job's actor for good, and its workers with it (they would end themselves within
        seconds; a worker that died while no coordinator watched would leave its placement group)."""
        import ray

        from service.pool.detached import end_workers

        try:
            ray.kill(ray.get_actor(actor_name(job_id), namespace=self.namespace), no_restart=True)
        except ValueError:
            pass
        end_workers(job_id, self.namespace)

    def cluster(self):
        from service.pool.cluster import ClusterWatcher

        return ClusterWatcher().poll()

    def in_use(self, snap) -> dict[str, tuple[float, float]] | None:
        """{node_id: (cpus, gpus)} Ray reports in use: what jobs outside the service hold shows here."""
        from service.pool.cluster import resources_in_use

        return resources_in_use(snap)
