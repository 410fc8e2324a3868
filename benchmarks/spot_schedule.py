"""A spot trace and the replay schedule made from one of its windows (pure: no Ray, no torch).

A trace is a CSV of `time_ms,add|remove,node_id` lines (an instance granted or preempted), as in
../shared/data/spot-traces (its README). Its size, the cluster the trace's user asked for, is read from
the file: the most instances alive at once.

Mapping one window onto K simulated nodes (`build_schedule`):
- the window starts with round(N * K / size) nodes (N: instances alive then; within 1..K);
- `events`: every trace event in the window is one simulated event at (t - window start) / compression
  wall seconds: an `add` adds a node (the lowest free slot), a `remove` removes one (a seeded random
  present slot), except that the cluster stays within 1..K nodes (events past those bounds are dropped
  and counted): bursts keep their shape, the level of availability is the trace's only at the start;
- `scaled`: the cluster follows round(alive * K / size) within 1..K (one simulated node per size/K
  instances): the level follows the trace, bursts shrink to the steps of that rounding;
- a removal has AWS's two-minute notice for a seeded share of removals: a drain 120 / compression s
  before the node is killed (never before it was added); the others are killed without a word.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

NOTICE_S = 120.0
"""AWS's spot interruption notice."""


class Mapping(str, Enum):
    EVENTS = "events"
    SCALED = "scaled"


class ActionKind(str, Enum):
    ADD = "add"
    NOTICE = "notice"
    """A drain with the notice's deadline."""
    REMOVE = "remove"


class WindowKind(str, Enum):
    BUSIEST = "busiest"
    MEDIAN = "median"
    CALM = "calm"


@dataclass(frozen=True, slots=True)
class TraceEvent:
    t_s: float
    op: str
    """add or remove"""
    node: str


def load_trace(path: Path) -> list[TraceEvent]:
    """`time_ms,add|remove,node_id` lines, in time order (ties keep the file's order)."""
    out = []
    with open(path) as f:
        for i, row in enumerate(csv.reader(f), 1):
            if not row:
                continue
            if len(row) != 3 or row[1] not in ("add", "remove"):
                raise ValueError(f"{path}:{i}: expected time_ms,add|remove,node_id, got {row!r}; "
                                 "fix the line or pass another --trace")
            try:
                t = int(row[0]) / 1000.0
            except ValueError:
                raise ValueError(f"{path}:{i}: time_ms must be an integer, got {row[0]!r}") from None
            out.append(TraceEvent(t_s=t, op=row[1], node=row[2]))
    if not out:
        raise ValueError(f"{path}: no events; a trace needs time_ms,add|remove,node_id lines")
    return sorted(out, key=lambda e: e.t_s)


def trace_size(events: list[TraceEvent]) -> int:
    """The most instances alive at once: the cluster size the trace's user asked for."""
    alive: set[str] = set()
    most = 0
    for e in events:
        (alive.add if e.op == "add" else alive.discard)(e.node)
        most = max(most, len(alive))
    return most


def alive_at(events: list[TraceEvent], t_s: float) -> int:
    """Instances alive in the trace just before `t_s` (events at exactly t_s not yet applied)."""
    alive: set[str] = set()
    for e in events:
        if e.t_s >= t_s:
            break
        (alive.add if e.op == "add" else alive.discard)(e.node)
    return len(alive)


def window_counts(events: list[TraceEvent], window_s: float, *, step_s: float = 60.0) -> list[tuple[float, int]]:
    """(start, events in [start, start + window_s)) for every whole-`step_s` start from `step_s` (after
    the initial grants at t=0) whose window ends by the trace's last event."""
    end = events[-1].t_s
    out = []
    t = step_s
    while t + window_s <= end:
        out.append((t, sum(1 for e in events if t <= e.t_s < t + window_s)))
        t += step_s
    if not out:
        raise ValueError(f"the trace lasts {end:.0f} s: no window of {window_s:.0f} s fits after {step_s:.0f} s; "
                         "pass a shorter --window-min")
    return out


def choose_windows(events: list[TraceEvent], window_s: float, *, step_s: float = 60.0) -> dict[WindowKind, float]:
    """The starts of the busiest window (most events), a median one (the lower median of the counts)
    and the calmest (fewest events) of length `window_s`; the earliest start on a tie."""
    counts = window_counts(events, window_s, step_s=step_s)
    ranked = sorted(counts, key=lambda c: (c[1], c[0]))
    busiest = max(counts, key=lambda c: (c[1], -c[0]))
    return {WindowKind.BUSIEST: busiest[0], WindowKind.MEDIAN: ranked[(len(ranked) - 1) // 2][0],
            WindowKind.CALM: ranked[0][0]}


@dataclass(frozen=True, slots=True)
class Action:
    at: float
    """Wall seconds after the replay starts."""
    kind: ActionKind
    slot: int
    notice: bool = False
    """For a removal: whether a notice preceded it."""


@dataclass(frozen=True, slots=True)
class Schedule:
    k: int
    k0: int
    actions: tuple[Action, ...]
    availability: tuple[tuple[float, int], ...]
    """(wall seconds, nodes alive from then on), starting with (0, k0)."""
    duration_s: float
    notice_s: float
    """Wall seconds between a notice and its removal."""
    dropped: int
    """Trace events that would have left 1..k (events) or did not change round(alive * k / size) (scaled)."""
    trace_events: int
    trace_size: int


_ORDER = {ActionKind.ADD: 0, ActionKind.NOTICE: 1, ActionKind.REMOVE: 2}


def build_schedule(events: list[TraceEvent], *, start_s: float, window_s: float, k: int, compression: float,
                   notice_share: float, seed: int = 0, mapping: Mapping = Mapping.EVENTS,
                   size: int | None = None) -> Schedule:
    """The replay of trace window [start_s, start_s + window_s) on at most `k` nodes (module docstring).
    `size`: the trace's cluster size (default: `trace_size(events)`)."""
    mapping = Mapping(mapping)
    if k < 1 or compression <= 0 or window_s <= 0 or not 0 <= notice_share <= 1:
        raise ValueError(f"need k >= 1, compression > 0, window_s > 0 and 0 <= notice_share <= 1; got k={k}, "
                         f"compression={compression}, window_s={window_s}, notice_share={notice_share}")
    size = trace_size(events) if size is None else size
    if size < 1:
        raise ValueError("the trace never has an instance alive; check its add/remove lines")
    rng = random.Random(seed)

    def scaled(n: int) -> int:
        return min(k, max(1, round(n * k / size)))

    alive: set[str] = set()
    for e in events:
        if e.t_s >= start_s:
            break
        (alive.add if e.op == "add" else alive.discard)(e.node)
    k0 = scaled(len(alive))
    present = set(range(k0))
    added_at = dict.fromkeys(present, 0.0)
    notice_wall = NOTICE_S / compression
    actions: list[Action] = []
    avail = [(0.0, k0)]
    dropped = n = 0
    for e in events:
        if not start_s <= e.t_s < start_s + window_s:
            continue
        n += 1
        at = (e.t_s - start_s) / compression
        (alive.add if e.op == "add" else alive.discard)(e.node)
        if mapping is Mapping.SCALED:
            want = scaled(len(alive))
            if want == len(present):
                dropped += 1
                continue
            op = "add" if want > len(present) else "remove"
        else:
            op = e.op
        if op == "add":
            if len(present) >= k:
                dropped += 1
                continue
            slot = min(set(range(k)) - present)
            present.add(slot)
            added_at[slot] = at
            actions.append(Action(at=at, kind=ActionKind.ADD, slot=slot))
        else:
            if len(present) <= 1:
                dropped += 1
                continue
            slot = rng.choice(sorted(present))
            noticed = rng.random() < notice_share
            present.discard(slot)
            if noticed:
                actions.append(Action(at=max(added_at[slot], at - notice_wall), kind=ActionKind.NOTICE, slot=slot))
            actions.append(Action(at=at, kind=ActionKind.REMOVE, slot=slot, notice=noticed))
        avail.append((at, len(present)))
    actions.sort(key=lambda a: (a.at, _ORDER[a.kind]))
    return Schedule(k=k, k0=k0, actions=tuple(actions), availability=tuple(avail), duration_s=window_s / compression,
                    notice_s=notice_wall, dropped=dropped, trace_events=n, trace_size=size)


def mean_nodes(sched: Schedule) -> float:
    """Nodes available on average over the replay."""
    total = 0.0
    for (t, k), nxt in zip(sched.availability, [*sched.availability[1:], (sched.duration_s, 0)]):
        total += (min(nxt[0], sched.duration_s) - t) * k
    return total / sched.duration_s if sched.duration_s > 0 else 0.0
