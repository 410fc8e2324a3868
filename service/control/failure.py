"""What recovery does after a failure: one pure decision over the failure's kind and the facts around it.

A failure without notice (a preemption with notice is a planned resize, not a failure) reaches the
coordinator as a `FailureKind` (service.pool.group), whoever noticed it: the watcher, the group's probe,
a worker's death. `classify` folds a worker's death on a node found dead into the node's loss, so one
node loss is one kind for the retry budget. `respond` says, from the kind and the facts, what the
recovery does: whether it asks the survivors for their state (else the next group loads the last
committed checkpoint), whether they abort their process groups first, how long it waits for their
answers, and which of their offers may form the next group (their live state: a heal; their peer
snapshots: memory). `live_gap` judges, from the survivors' answers, whether their live state can heal
the group; `service.control.source.from_survivors` then picks between that and their snapshots. The
coordinator's recovery (service.control.recovery) carries the answers out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from parallel.exchange import survivors_hold_everything
from parallel.layout import Layout
from service.pool.group import FailureKind
from workers.report import Salvaged

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


def classify(kind: FailureKind, *, on_dead_node: bool) -> FailureKind:
    """The kind a failure counts as: a worker that died, or a call that hung, where a node of the
    group is found dead is that node's loss (the worker was only the first to notice)."""
    if on_dead_node and kind in (FailureKind.WORKER_DIED, FailureKind.TIMED_OUT):
        return FailureKind.NODE_LOST
    return kind


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
    why_not: str = ""
    """Why nothing is salvaged (the fallback event says it), when `salvage` is False."""

    @property
    def source_family(self) -> str:
        """"survivors" (the next group may form from what they hold) or "storage" (the checkpoint)."""
        return "survivors" if self.salvage else "storage"


def respond(f: Facts) -> Response:
    """The recovery's answer to a failure. Rules, the first that applies decides:
      1. no live resharding, or no group to salvage: storage;
      2. a failed transfer with snapshots off: storage (the members handed their live state over);
      3. a failed transfer with snapshots on: salvage for the peer snapshots only (the live state went
         with the transfer);
      4. a failed re-form from storage: salvage, waiting RESTORE_PATIENCE_S;
      5. a coordinator restart: salvage without aborting (no peer died);
      6. otherwise: salvage, aborting the survivors' collectives, waiting PATIENCE_S.
    """
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
