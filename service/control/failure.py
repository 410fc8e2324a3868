"""Every recovery decision, pure: what a failure is counted as, how to answer it, what its survivors can
form the next group from, each survivor's fate, and when to give up.

A failure without notice (a preemption with notice is a planned resize, not a failure) reaches the
coordinator as a `FailureKind` (service.pool.group), whoever noticed it: the watcher, the group's probe,
a worker's death. The decisions, in the order a recovery asks them:
  - `respond(Facts)`: from the kind and what the group was doing, whether to ask the survivors for their
    state, whether they abort their process groups first, how long their answers are waited for, which
    of their offers may form the next group (their live state: a heal; their peer snapshots: memory),
    and, after a coordinator restart, whether the workers taken over simply train on;
  - `fate(answer)`: what the group does with each member once it has answered (keep it to heal from,
    keep it idle as a warm process, stop it), which the group then carries out (`Group.salvage`);
  - `judge(...)`: from the kept members' answers, the source of the next group (`Heal`, `Memory`) or
    why neither (the next group loads the last committed checkpoint);
  - `classify`: the kind the failure is counted under (a worker's death on a dead node is the node's
    loss), and `within_window`, the one rule for which failures the ledger keeps;
  - `give_up(...)`: whether the restart budget is spent (or the failure is one no restart mends).
The coordinator's recovery (service.control.recovery) asks these and carries the answers out; nothing
else decides any of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from parallel.exchange import survivors_hold_everything
from parallel.layout import Layout
from parallel.peers import Cover, cover
from parallel.planner import Plan
from service.control.source import Heal, Memory, Survivors
from service.pool.group import FailureKind, Fate
from workers.report import Salvaged, StepMetrics

PATIENCE_S = 15.0
"""How long the survivors of a failed training group are waited for: a salvage that aborts their
collectives and reads their shards answers in well under a second; one stuck longer is given up."""
RESTORE_PATIENCE_S = 1.0
"""After a failed re-form from storage the members hold nothing the checkpoint does not: those that
answer at once stay warm, those stuck in a rendezvous with a dead rank are not waited for."""


class During(StrEnum):
    """What the group was doing when it failed."""

    TRAINING = "training"
    """A call on a formed group: training steps, a checkpoint, the flush before a resize."""
    TRANSFER = "transfer"
    """A live move or a heal: the members had handed their live state over to the transfer."""
    RESTORE = "restore"
    """Forming a group from the last committed checkpoint."""
    TAKEOVER = "takeover"
    """A restarted coordinator taking over the workers its predecessor left running."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Failure:
    """One unplanned loss of the worker group, as the restart budget counts it. Preemptions and planned
    resizes are not failures."""

    time: float
    """Unix seconds."""
    kind: FailureKind
    """What failed, coarse enough to repeat (one node's loss is NODE_LOST whoever noticed it)."""
    error: str = ""
    """The error text, quoted when the budget gives up."""


FINAL_KINDS = frozenset({FailureKind.CONFIG_REJECTED})
"""Failure kinds that fail the job at the first one: a worker found the configuration unusable, which
no restart changes."""


def classify(kind: FailureKind, *, on_dead_node: bool) -> FailureKind:
    """The kind a failure counts as: a worker that died, or a call that hung, where a node of the
    group is found dead is that node's loss (the worker was only the first to notice)."""
    if on_dead_node and kind in (FailureKind.WORKER_DIED, FailureKind.TIMED_OUT):
        return FailureKind.NODE_LOST
    return kind


def within_window(failures: Sequence[Failure], *, now: float, window_s: float) -> list[Failure]:
    """The failures the ledger keeps: those within the restart window, and any final one (which ends the
    job), so the ledger is as long as the budget, not as long as the job."""
    return [f for f in failures if f.time > now - window_s or f.kind in FINAL_KINDS]


def give_up(failures: Sequence[Failure], *, now: float, max_restarts: int, window_s: float) -> str | None:
    """Why the job is not restarted again (None: it is). At once for a failure of a final kind (a worker
    refused the job's configuration); else when one kind occurred more than `max_restarts` times within
    `window_s` before `now`: restarting again would most likely fail the same way. The reason names the
    kind whose latest failure is the most recent (what just happened) and quotes its last error."""
    if final := next((f for f in reversed(failures) if f.kind in FINAL_KINDS), None):
        return f"the job's configuration cannot run, so it is not restarted: {final.error}"
    recent: dict[FailureKind, list[Failure]] = {}
    for f in failures:
        if f.time > now - window_s:
            recent.setdefault(f.kind, []).append(f)
    over = [(kind, fs) for kind, fs in recent.items() if len(fs) > max_restarts]
    if not over:
        return None
    kind, fs = max(over, key=lambda kv: max(f.time for f in kv[1]))
    last = max(fs, key=lambda f: f.time)
    return (f"{kind} failed {len(fs)} times in the last {window_s:g} s (max_restarts={max_restarts}); "
            f"last error: {last.error or '(none)'}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Facts:
    """What the coordinator knows when a failure reaches it."""

    kind: FailureKind
    during: During
    live_reshard: bool
    """`parallel.reshard` is "live": state may move between workers (else only through storage)."""
    holds_group: bool
    """A group with members, formed for a plan the coordinator knows (what their shards are checked against)."""
    snapshots: bool
    """Peer snapshots are on (`checkpoint.peer_interval` > 0)."""
    standing: bool = False
    """(TAKEOVER) the workers taken over are still the lost plan's training group, every rank sound and at
    one step (`Group.carry_on`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Response:
    """What the recovery does."""

    salvage: bool
    """Ask the survivors for their state (else the next group loads the last committed checkpoint)."""
    abort: bool = True
    """Abort their process groups first (a peer died: calls stuck in a collective must raise); not
    when only their coordinator died."""
    patience_s: float = PATIENCE_S
    """How long their answers are waited for."""
    heal: bool = False
    """Their live state may form the next group (`source.Heal`)."""
    memory: bool = False
    """Their peer snapshots may form it (`source.Memory`)."""
    carry_on: bool = False
    """The workers taken over train on as they are: nothing is salvaged, re-formed or moved."""
    why_not: str = ""
    """Why nothing is salvaged (the fallback event says it), when neither `salvage` nor `carry_on`."""


def respond(f: Facts) -> Response:
    """The recovery's answer to a failure. Rules, the first that applies decides:
      1. a takeover whose workers still stand as the lost plan's group: they carry on (nothing moves,
         so under either `parallel.reshard`);
      2. no live resharding, or no group to salvage: storage;
      3. a failed transfer with snapshots off: storage (the members handed their live state over);
      4. a failed transfer with snapshots on: salvage for the peer snapshots only (the live state went
         with the transfer);
      5. a failed re-form from storage: salvage, waiting RESTORE_PATIENCE_S;
      6. a coordinator restart: salvage without aborting (no peer died);
      7. otherwise: salvage, aborting the survivors' collectives, waiting PATIENCE_S.
    """
    if f.during is During.TAKEOVER and f.standing and f.holds_group:
        return Response(salvage=False, carry_on=True)
    if not f.live_reshard:
        return Response(salvage=False, why_not="parallel.reshard is storage: state moves only through checkpoints")
    if not f.holds_group:
        return Response(salvage=False, why_not="no formed group is left to salvage")
    if f.during is During.TRANSFER:
        if not f.snapshots:
            return Response(salvage=False, why_not="the workers handed their state over to the transfer that "
                                                    "failed, and peer snapshots are off")
        return Response(salvage=True, memory=True)
    if f.during is During.RESTORE:
        return Response(salvage=True, patience_s=RESTORE_PATIENCE_S, heal=True, memory=f.snapshots)
    abort = f.kind is not FailureKind.COORDINATOR_RESTARTED
    return Response(salvage=True, abort=abort, heal=True, memory=f.snapshots)


def fate(answer: Salvaged | None) -> Fate:
    """The fate of a member whose salvage answered `answer` (None: it did not answer, or is on a dead node):
    kept to form the next group from where it holds live shards or peer snapshots, kept idle where it
    holds nothing but is sound, else stopped. `Group.salvage` is given this rule and carries it out."""
    if answer is None:
        return Fate.STOP
    if answer.held or answer.snapshots:
        return Fate.KEEP
    return Fate.IDLE if answer.reusable else Fate.STOP


def live_gap(layout: Layout, answers: Mapping[int, Salvaged], *, last_step: int) -> str | None:
    """Why the survivors' live state cannot heal a group of `layout` (None: it can). `answers`: each
    kept survivor's by its old rank; `last_step`: the last step the job has recorded (the metrics of a
    step the survivors finished must have come back with them)."""
    live = {r: a for r, a in answers.items() if a.held}
    steps = {a.step for a in live.values()}
    rows = max((a.rows for a in live.values()), key=len, default=())
    last_row = rows[-1].step if rows else last_step
    if not live:
        return "no worker answered with state it can vouch for"
    if len(live) != len(answers):
        return f"ranks {sorted(set(answers) - set(live))} cannot vouch for their live state"
    if len(steps) != 1:
        return f"the survivors stopped at different steps {sorted(steps)}"
    if not survivors_hold_everything(layout, live):
        return f"ranks {sorted(live)} of {layout} do not hold every shard between them"
    if max(steps) != max(last_row, last_step):
        return f"the metrics of step {max(steps)} were lost with the failed worker"
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    """What a failed group's kept members can form the next group from (`judge`)."""

    source: Survivors | None
    """`Heal` (their live state, nothing redone), `Memory` (their peer snapshots, the steps since redone), or
    None: the next group loads the last committed checkpoint."""
    why_not_live: str = ""
    """Why their live state does not heal it ("" for a heal)."""
    why_not_memory: str = ""
    """Why their peer snapshots do not form it either (when `source` is None)."""
    step: int | None = None
    """The job's step from now on (that of the state kept); None when nothing is kept."""
    rows: tuple[StepMetrics, ...] = ()
    """The metrics rows of steps the survivors finished that the coordinator never read."""


def judge(old: Plan, response: Response, answers: Mapping[int, Salvaged], *, last_step: int) -> Verdict:
    """The source of the next group from the answers of `old`'s kept members (by old rank): their live
    state where it holds every shard at one step and `response.heal` allows it, else the peer snapshots
    that cover every shard of one snapshot step (`parallel.peers.cover`) where any are held or
    `response.memory` asks for them, else none, saying why."""
    live = {r: a for r, a in answers.items() if a.held}
    rows = max((a.rows for a in live.values()), key=len, default=())
    why = (live_gap(old.layout, answers, last_step=last_step) if response.heal else
           "the live state went with the transfer that failed")
    if why is None:
        return Verdict(source=Heal(old=old, ranks=tuple(sorted(live))), step=next(iter(live.values())).step,
                       rows=rows)
    copies = {r: a.snapshots for r, a in answers.items() if a.snapshots}
    if not copies and not response.memory:
        return Verdict(source=None, why_not_live=why, why_not_memory="peer snapshots are off")
    covered = cover(old.layout, copies)
    if isinstance(covered, Cover):
        at = max([last_step, *(a.step for a in live.values()), *(r.step for r in rows)])
        return Verdict(source=Memory(old=old, step=covered.step, serve=tuple(sorted(covered.serve.items()))),
                       why_not_live=why, step=at, rows=rows)
    return Verdict(source=None, why_not_live=why, why_not_memory=covered.why)
