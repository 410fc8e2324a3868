"""Waiting on calls to workers, and probing their nodes meanwhile.

A call on a worker whose node died is reported by Ray only once its health checks declare the node
dead (~15 s or more; a placement group there waits for good). So while a group waits on workers (a
start, a form, a hand-over, a transfer, a checkpoint, a step) it probes their nodes
(`service.pool.placement.probe_nodes`) at `probe_gaps`, and a node that does not answer fails the wait
within seconds (WorkerFailure NODE_LOST). A failed call becomes a WorkerFailure of its kind (`failure`);
the refs a wait gave up on are read once they end (`Calls.settle`), so their errors, expected after a
failure, go to this logger at debug level rather than being printed by Ray as unhandled.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from service.pool.group import FailureKind, WorkerFailure
from service.pool.placement import probe_nodes
from workers.strict import ConfigError

__all__ = ["FIRST_PROBE_S", "Calls", "failure", "probe_gaps", "replies"]

logger = logging.getLogger(__name__)

FIRST_PROBE_S = 0.5
"""A wait on workers probes their nodes first after this long: soon enough to catch a node that died
just before the call (a second fault right after a first), late enough that a quick call (a live
resize's form) never pays for a probe."""


def probe_gaps(cap_s: float) -> Iterator[float]:
    """Seconds before each probe of a wait on workers: FIRST_PROBE_S, then 1 s, doubling up to `cap_s`:
    close together early, when a second fault is most likely, and every `cap_s` through a long wait (a
    checkpoint load of minutes), so that a large group does not flood the GCS with probe placement groups."""
    yield min(FIRST_PROBE_S, cap_s)
    gap = 1.0
    while True:
        yield min(gap, cap_s)
        gap *= 2


def failure(e: RayError, what: str, timeout: float | None) -> WorkerFailure:
    """The WorkerFailure a failed call during `what` stands for: a worker that died, a wait past
    `timeout`, a worker that rejected the job's configuration, or one that raised."""
    if isinstance(e, RayActorError):
        return WorkerFailure(FailureKind.WORKER_DIED, f"a worker died during {what}: {str(e).splitlines()[0]}")
    if isinstance(e, GetTimeoutError):
        return WorkerFailure(FailureKind.TIMED_OUT, f"workers did not finish {what} within {timeout:.0f}s")
    cause = getattr(e, "cause", None)
    kind = FailureKind.CONFIG_REJECTED if isinstance(cause, ConfigError) else FailureKind.WORKER_RAISED
    msg = str(cause) if cause is not None else str(e).splitlines()[-1]
    return WorkerFailure(kind, f"a worker raised during {what}: {msg}")


def replies(refs: list, *, timeout_s: float, grace_s: float, skip: Callable[[], set] = set) -> set:
    """The refs that finish within `timeout_s`, waiting at most `grace_s` more once the first has: a
    member on a node that vanished may take Ray many seconds to declare dead, and its peers answer
    in well under a second. Refs in `skip()` (asked again every 0.1 s) are not waited for."""
    deadline = time.monotonic() + timeout_s
    ready: set = set()
    while (waiting := [r for r in refs if r not in ready and r not in skip()]) \
            and (left := deadline - time.monotonic()) > 0:
        done, _ = ray.wait(waiting, num_returns=1, timeout=min(0.1, left))
        if not ready and done:
            deadline = min(deadline, time.monotonic() + grace_s)
        ready.update(done)
    return ready


class Calls:
    """A group's waits on its workers' calls: `probe_cap_s`, the longest gap between two probes of a wait
    (`probe_gaps`); `probe_timeout_s`, how long a node has to answer one."""

    def __init__(self, *, probe_cap_s: float, probe_timeout_s: float):
        self.probe_cap_s, self.probe_timeout_s = probe_cap_s, probe_timeout_s
        self._unread: list = []
        """Refs of calls the group stopped waiting for (the other ranks' `run` once one rank failed, say):
        read when they have ended (`settle`)."""

    def gaps(self) -> Iterator[float]:
        """The gaps between the probes of one wait."""
        return probe_gaps(self.probe_cap_s)

    def stop_waiting(self, refs: list) -> None:
        """Refs no wait reads any more: `settle` reads them once they have ended."""
        self._unread += refs

    def get(self, refs: list, what: str, timeout: float | None = None, *, also: list = ()) -> list:
        """`ray.get(refs)`, with a failure as WorkerFailure; then the refs not read (the others of a call
        on every rank, and `also`) are set aside (`stop_waiting`)."""
        try:
            return ray.get(refs, timeout=timeout)
        except RayError as e:
            self.stop_waiting([*refs, *also])
            raise failure(e, what, timeout) from e

    def await_probing(self, refs: list, what: str, *, nodes: Callable[[], list[str]], timeout_s: float) -> list:
        """`get(refs)`, probing `nodes()` (`probe_gaps`) while some have not answered."""
        deadline = time.monotonic() + timeout_s
        pending, gaps = list(refs), self.gaps()
        next_probe = time.monotonic() + next(gaps)
        while pending:
            now = time.monotonic()
            if now >= deadline:
                self.stop_waiting(refs)
                raise WorkerFailure(FailureKind.TIMED_OUT, f"workers did not finish {what} within {timeout_s:.0f}s")
            # woken by each answer, not only by the last: a rank that failed fails the wait at once
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, min(deadline, next_probe) - now))
            for ref in done:
                self.get([ref], what, timeout=0, also=refs)
            if pending and time.monotonic() >= next_probe:
                self.probe_or_fail(nodes(), f"during {what}")
                next_probe = time.monotonic() + next(gaps)
        return self.get(refs, what, timeout=0)

    def probe_or_fail(self, nodes: list[str], during: str) -> None:
        """WorkerFailure(NODE_LOST) if one of `nodes` does not answer a probe: a call waiting on a worker
        there would otherwise wait out Ray's own detection of the dead node (~15 s or more), and a
        placement group there would wait for good."""
        if dead := set(nodes) - probe_nodes(nodes, timeout_s=self.probe_timeout_s):
            raise WorkerFailure(FailureKind.NODE_LOST, f"node(s) {', '.join(n[:8] for n in sorted(dead))} stopped answering "
                                        f"{during}", nodes=dead)

    def settle(self) -> None:
        """Read the calls set aside that have ended; keep the others."""
        if not self._unread:
            return
        refs = list(dict.fromkeys(self._unread))
        done, self._unread = ray.wait(refs, num_returns=len(refs), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except RayError as e:
                logger.debug("a call the group no longer waited for ended in %s: %s", type(e).__name__,
                             (str(e).strip().splitlines() or [""])[-1])
