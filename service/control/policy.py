"""When to resize or wait: a scaling policy that turns cluster facts into a decision.

Pure: no Ray, no clock, no sleeping. The caller passes `now` and what it observed; the only state
kept between calls is the growth settle timer. That makes every timing rule testable to the second.

Rules, in order (the first that applies decides; whether failures have spent the restart budget is
the recovery's decision, service.control.failure.give_up, asked before this one):
  1. Wait   when usable workers < min_workers: the job cannot run; hold nothing until capacity returns.
  2. Resize (start) when nothing runs (current_workers == 0): start at once on what is offered,
            cause "planned"; there is nothing to disrupt, so no settle time.
  3. Resize (shrink) when fewer workers are offered than run: at once with cause "failure" when
            capacity is simply gone, "user" when only a lowered max_workers caps it; cause "preemption"
            when nodes the group runs on are draining (`leaving`: its workers there). The group also
            moves off draining nodes when the rest offers as many workers as run (or more: the move
            takes them too), cause "preemption". A drain trains on until it must move:
            while every draining node has a deadline and `now < earliest deadline - drain_lead_s` (the
            caller's lead: service.control.drain), and the drain alone explains the shortfall, the
            decision is a Noop saying when the group moves off (`move_at`); then it moves, live or
            through a checkpoint. No lead (None), a drain without a deadline, or a deadline already
            inside the lead: it moves at once.
  4. Resize (grow) when more workers are offered than run *and* that offer has stayed the same for
            settle_seconds *and* nothing holds it (`hold_growth(target)`, when given: the workers the
            growth adds still warming up beside the training group, a checkpoint save in flight; the
            group trains on meanwhile and stops only to move state and form). Any change of the offer (a node flapping, or another node still arriving)
            restarts the timer: every resize costs a checkpoint and a restart, so wait for arrivals
            to stop and then grow once.
  5. Noop   otherwise (its reason says how long a pending growth has settled).
A user's resize (`requested`: the range was just changed on the user's request) is a policy input too:
after rules 1-2, a target other than the running size is a Resize with cause "user" at once, with no
settle time.

On a shared cluster the scheduler (service.sharing.scheduler) grants each job a number of workers; `granted`
caps the offer further. A shrink to the grant is cause "planned" (it goes through the planned-resize
path) and a growth up to the grant needs no settle time: the scheduler has already decided.

"Offered" is min(usable_workers, max_workers), passed through `size_for` when given: the number of
workers a layout can actually use (e.g. `lambda n: plan(n, model, constraints).world_size`), so that
5 usable workers for a model that only runs on 4 do not trigger a pointless resize every tick.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass



@dataclass(frozen=True, slots=True)
class Noop:
    reason: str = ""
    """Empty, or what is pending (e.g. growth still settling)."""
    move_at: float | None = None
    """While the group trains on with draining nodes: when it moves off them (unix s; rule 3)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Resize:
    workers: int
    """The worker count to run with next."""
    cause: str
    """"planned" (start), "grow", "preemption", "failure" or "user"."""
    reason: str


@dataclass(frozen=True, slots=True)
class Wait:
    reason: str
    by_scheduler: bool = False
    """The scheduler's grant, not the cluster, is what is too small (the job is QUEUED, not waiting)."""


@dataclass(frozen=True, slots=True)
class Fail:
    """Give up: the restart budget is spent (service.control.failure.give_up says why)."""

    reason: str


Decision = Noop | Resize | Wait | Fail

def _is_int(v: object, lo: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= lo


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyConfig:
    min_workers: int = 1
    """Fewest workers the job may run on; below this it waits."""
    max_workers: int | None = None
    """Most workers the job may use; None means no cap."""
    settle_seconds: float = 30.0
    """How long a larger offer must stay unchanged before growing."""
    max_restarts: int = 3
    """Restarts allowed per failure kind within restart_window_s; one more failure of that kind fails the job."""
    restart_window_s: float = 3600.0
    """Sliding window for counting failures of one kind."""

    def __post_init__(self) -> None:
        if not _is_int(self.min_workers, 1):
            raise ValueError(f"min_workers must be an integer >= 1, got {self.min_workers!r}")
        if self.max_workers is not None:
            if not _is_int(self.max_workers, 1):
                raise ValueError(f"max_workers must be an integer >= 1 or None, got {self.max_workers!r}")
            if self.max_workers < self.min_workers:
                raise ValueError(f"max_workers={self.max_workers} is less than min_workers={self.min_workers}")
        if not isinstance(self.settle_seconds, (int, float)) or not self.settle_seconds >= 0:
            raise ValueError(f"settle_seconds must be >= 0, got {self.settle_seconds!r}")
        if not _is_int(self.max_restarts, 0):
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not isinstance(self.restart_window_s, (int, float)) or not self.restart_window_s > 0:
            raise ValueError(f"restart_window_s must be > 0, got {self.restart_window_s!r}")


def _drain_text(now: float, draining: Mapping[str, float | None]) -> str:
    """"node 1a2b3c4d drains in 28.0 s" for the earliest deadline (or "draining, no deadline")."""
    if not draining:
        return ""
    timed = {n: d for n, d in draining.items() if d is not None}
    if timed:
        node, deadline = min(timed.items(), key=lambda kv: kv[1])
        first = f"node {node[:8]} drains in {deadline - now:.1f} s"
    else:
        node = min(draining)
        first = f"node {node[:8]} is draining (no deadline)"
    more = f" (+{len(draining) - 1} more draining)" if len(draining) > 1 else ""
    return first + more


def _drain_hold(now: float, draining: Mapping[str, float | None], lead_s: float | None) -> Noop | None:
    """The Noop that keeps the group training with its draining nodes, or None when it must move off
    them now: no lead, a drain without a deadline, or the earliest deadline within the lead."""
    if lead_s is None or not draining or any(d is None for d in draining.values()):
        return None
    move_at = min(d for d in draining.values() if d is not None) - lead_s
    if now >= move_at:
        return None
    return Noop(f"{_drain_text(now, draining)}; moving off it in {move_at - now:.1f} s, {lead_s:.1f} s before "
                f"its deadline", move_at=move_at)


class ScalingPolicy:
    """Decides Noop / Resize / Wait / Fail from explicit observations (see the module docstring)."""

    def __init__(self, config: PolicyConfig | None = None, *, size_for: Callable[[int], int | None] | None = None,
                 hold_growth: Callable[[int], str] | None = None):
        """`hold_growth(target)`: why a settled growth to `target` must wait a little longer, the group
        training on meanwhile (e.g. "its joining workers start and warm up"), or "" to go; None: never held."""
        self.config = config or PolicyConfig()
        self._size_for = size_for
        self._hold_growth = hold_growth
        self._grow_target: int | None = None
        self._grow_since: float | None = None

    def decide(self, now: float, *, current_workers: int, usable_workers: int,
               draining: Mapping[str, float | None] | None = None,
               granted: int | None = None, requested: bool = False, short_because: str = "",
               leaving: int | None = None, drain_lead_s: float | None = None) -> Decision:
        """`current_workers`: size of the running group (0 when none runs). `usable_workers`: how many
        workers fit on alive, non-draining nodes. `draining`: {node_id: deadline unix s or None}. `granted`:
        the workers the scheduler grants this job (None: no scheduler, the whole cluster is offered).
        `requested`: the user has just changed the job's worker range, and waits for it to act.
        `short_because`: why the cluster offers too few workers, when the caller knows (said in a Wait).
        `leaving`: the running workers on draining nodes (None: not known; a shortfall while nodes drain
        is then taken to be theirs). `drain_lead_s`: how long before a drain's deadline the group must
        start moving off its node (None: at once)."""
        c = self.config
        for name, v in (("current_workers", current_workers), ("usable_workers", usable_workers),
                        ("granted", 0 if granted is None else granted), ("leaving", 0 if leaving is None else leaving)):
            if not _is_int(v, 0):
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if drain_lead_s is not None and not (isinstance(drain_lead_s, (int, float)) and drain_lead_s >= 0):
            raise ValueError(f"drain_lead_s must be a number of seconds >= 0 or None, got {drain_lead_s!r}")
        draining = dict(draining or {})

        drains = _drain_text(now, draining)
        if usable_workers < c.min_workers:
            why = f"{usable_workers} usable workers < min_workers={c.min_workers}" + \
                (f" ({short_because})" if short_because else "")
            return self._reset(Wait(f"{why}; {drains}" if drains else why))
        if granted is not None and granted < c.min_workers:
            return self._reset(Wait(f"the scheduler grants {granted} workers < min_workers={c.min_workers}",
                                    by_scheduler=True))
        offered = usable_workers if c.max_workers is None else min(usable_workers, c.max_workers)
        by_grant = granted is not None and granted < offered  # the grant, not the cluster, limits the offer
        offered = granted if by_grant else offered
        target = offered if self._size_for is None else self._size_for(offered)
        if target is None or target < c.min_workers:
            return self._reset(Wait(f"no usable layout on {offered} offered workers (min_workers={c.min_workers})"))
        if target > offered:
            raise ValueError(f"size_for({offered}) returned {target}, more workers than offered")

        if current_workers == 0:
            return self._reset(Resize(workers=target, cause="planned", reason=f"start on {target} workers (" + (
                f"{usable_workers} usable)" if granted is None else f"granted {granted} by the scheduler)")))
        if requested and target != current_workers:
            return self._reset(Resize(workers=target, cause="user",
                                      reason=f"resize to {target} workers requested by user"))
        drained = bool(draining) if leaving is None else leaving > 0  # the group runs on draining nodes
        if offered < current_workers:
            if by_grant:
                cause, why = "planned", f"the scheduler grants {granted} workers"
            elif usable_workers >= current_workers:
                cause, why = "user", f"max_workers={c.max_workers} is below the {current_workers} running"
            elif drained:
                alone = leaving is None or usable_workers + leaving >= current_workers
                if alone and (hold := _drain_hold(now, draining, drain_lead_s)) is not None:
                    return self._reset(hold)
                cause, why = "preemption", f"{usable_workers} usable workers < {current_workers} running; {drains}"
            else:
                cause, why = "failure", f"{usable_workers} usable workers < {current_workers} running (capacity lost)"
            return self._reset(Resize(workers=target, cause=cause, reason=f"shrink to {target}: {why}"))
        if leaving:  # as many workers offered elsewhere: the group still has to leave the draining nodes
            if (hold := _drain_hold(now, draining, drain_lead_s)) is not None:
                return self._reset(hold)
            return self._reset(Resize(workers=target, cause="preemption",
                                      reason=f"move to {target} workers off the draining nodes ({leaving} of the "
                                             f"{current_workers} running are there); {drains}"))
        if target > current_workers:
            if by_grant or granted == offered:
                return self._reset(Resize(workers=target, cause="grow",
                                          reason=f"grow to {target}: the scheduler grants {granted} workers"))
            if self._grow_target != target:
                self._grow_target, self._grow_since = target, now
            waited = now - self._grow_since
            if waited >= c.settle_seconds and self._hold_growth is not None and (why := self._hold_growth(target)):
                return Noop(f"growth to {target} settled ({waited:.1f} s); waiting while {why}")
            if waited >= c.settle_seconds:
                return self._reset(Resize(workers=target, cause="grow",
                                          reason=f"grow to {target}: {usable_workers} usable workers > "
                                                 f"{current_workers} running, unchanged for {waited:.1f} s "
                                                 f"(settle_seconds={c.settle_seconds:g})"))
            return Noop(f"growth to {target} settling: {waited:.1f} of {c.settle_seconds:g} s")
        return self._reset(Noop())

    @property
    def pending_growth(self) -> tuple[int, float] | None:
        """(target workers, since) while a growth is settling, else None."""
        return None if self._grow_target is None else (self._grow_target, self._grow_since)

    def _reset(self, decision: Decision) -> Decision:
        self._grow_target = self._grow_since = None
        return decision
