"""The figures of a spot replay (pure): steady throughput per size, the ideal, goodput, work redone,
stalls charged to the events that started them, and the summary over many replays.

Rows are one system's steps in the order trained: {time (unix s), step, world_size, attempt (optional:
a worker group's id)}. Events are (unix time, StallCause) of what the replay did.
"""

from __future__ import annotations

import statistics
from enum import Enum


class StallCause(str, Enum):
    START = "start"
    """Before the window's first event."""
    JOIN = "join"
    NOTICED = "removal with notice"
    """The notice or the removal that followed it."""
    UNNOTICED = "removal without notice"


def steady_throughput(rows: list[dict], gbs: int, *, warmup: int = 2) -> dict[int, float]:
    """Samples per second at each world size: gbs / the median interval between consecutive steps
    (step = previous + 1, same size, same worker group) once `warmup` such intervals of each run of
    steps have passed (a group's first steps after forming are not its throughput)."""
    gaps: dict[int, list[float]] = {}
    run = 0
    for a, b in zip(rows, rows[1:]):
        same = (b["step"] == a["step"] + 1 and a["world_size"] == b["world_size"]
                and a.get("attempt") == b.get("attempt"))
        run = run + 1 if same else 0
        if same and run > warmup:
            gaps.setdefault(b["world_size"], []).append(b["time"] - a["time"])
    return {ws: gbs / statistics.median(xs) for ws, xs in sorted(gaps.items()) if xs}


def best_by_size(*measured: dict[int, float]) -> dict[int, float]:
    """The highest throughput any measurement reached at each size."""
    out: dict[int, float] = {}
    for m in measured:
        for k, v in m.items():
            out[k] = max(out.get(k, 0.0), v)
    return dict(sorted(out.items()))


def ideal_samples(availability: list[tuple[float, int]], duration_s: float, thr: dict[int, float]) -> float:
    """∫ thr(k(t)) dt over the replay, with no cost for changing size: the most samples any system could
    have trained at the measured rates. Every size the availability reaches must be measured."""
    total = 0.0
    for (t, k), nxt in zip(availability, [*availability[1:], (duration_s, None)]):
        t1 = min(nxt[0], duration_s)
        if t1 > t:
            if k not in thr:
                raise ValueError(f"no throughput measured at {k} workers (measured: {sorted(thr)}); "
                                 "calibrate every size from 1 to K")
            total += (t1 - t) * thr[k]
    return total


def charge(gap_start: float, gap_end: float, events: list[tuple[float, StallCause]]) -> StallCause:
    """The event that started a stall from `gap_start` to `gap_end`: the first event inside the gap; if
    none, the last one before it (a notice whose removal came later, a join the system acted on late);
    START if there was none yet."""
    inside = [c for t, c in events if gap_start < t < gap_end]
    if inside:
        return inside[0]
    before = [c for t, c in events if t <= gap_start]
    return before[-1] if before else StallCause.START


def analyse(rows: list[dict], *, t0: float, t_end: float, gbs: int, events: list[tuple[float, StallCause]],
            thr: dict[int, float], ideal: float) -> dict:
    """Goodput, work redone and stalls of one system over the window (t0, t_end].

    goodput: (the step reached at the end - the step at the start) x gbs / wall seconds: each step once,
    however often it was trained. A stall: a gap between steps (or from t0 to the first, or from the
    last to t_end) longer than 1.5x the interval the size that ended it takes at `thr`; what it cost is
    the gap less that interval, charged to the event that started it (`charge`)."""
    before = [r for r in rows if r["time"] <= t0]
    win = [r for r in rows if t0 < r["time"] <= t_end]
    step0 = before[-1]["step"] if before else 0
    step1 = win[-1]["step"] if win else step0
    counted = max(0, step1 - step0)
    wall = t_end - t0
    out = {"wall_s": round(wall, 2), "step_start": step0, "step_end": step1, "steps_counted": counted,
           "steps_trained": len(win), "steps_redone": len(win) - counted, "samples_counted": counted * gbs,
           "goodput_samples_per_s": counted * gbs / wall if wall > 0 else 0.0,
           "ideal_samples": round(ideal, 1), "goodput_vs_ideal": counted * gbs / ideal if ideal > 0 else None}
    stalls = dict.fromkeys(StallCause, 0.0)
    counts = dict.fromkeys(StallCause, 0)
    last_ws = before[-1]["world_size"] if before else (win[0]["world_size"] if win else None)
    points = [(t0, last_ws)] + [(r["time"], r["world_size"]) for r in win]
    points.append((t_end, win[-1]["world_size"] if win else last_ws))  # to the end, trained or not
    for (a, _), (b, ws) in zip(points, points[1:]):
        rate = thr.get(ws) if ws else None
        normal = gbs / rate if rate else 0.0
        if b - a > 1.5 * normal:
            cause = charge(a, b, events)
            stalls[cause] += b - a - normal
            counts[cause] += 1
    out["stall_s"] = {c.value: round(v, 2) for c, v in stalls.items()}
    out["stalls"] = {c.value: n for c, n in counts.items()}
    out["own_throughput_by_size"] = {str(k): round(v, 2) for k, v in steady_throughput(win, gbs).items()}
    return out


def above_ideal(results: dict[str, dict]) -> list[str]:
    """Systems whose goodput exceeds the ideal: the ideal is then not an upper bound (an error)."""
    return [name for name, r in results.items()
            if (a := r.get("analysis")) and a.get("goodput_vs_ideal") is not None and a["goodput_vs_ideal"] > 1.0]


def summarize(replays: list[dict]) -> dict[str, dict]:
    """Per system over replays ({"systems": {name: {"analysis": ...} or {"error": ...}}}): mean, min, max
    and standard deviation of goodput / ideal and of goodput, and how many replays failed."""
    by: dict[str, dict[str, list]] = {}
    for rep in replays:
        for name, r in rep["systems"].items():
            s = by.setdefault(name, {"ratio": [], "goodput": [], "errors": 0})
            a = r.get("analysis")
            if a is None:
                s["errors"] += 1
                continue
            s["ratio"].append(a["goodput_vs_ideal"])
            s["goodput"].append(a["goodput_samples_per_s"])

    def spread(xs: list[float]) -> dict:
        if not xs:
            return {"n": 0}
        return {"n": len(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
                "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0}

    return {name: {"goodput_vs_ideal": spread(s["ratio"]), "goodput_samples_per_s": spread(s["goodput"]),
                   "failed_replays": s["errors"]} for name, s in by.items()}


def loss_agreement(rows: list[dict], reference: list[float], *, tol: float = 1e-4) -> dict:
    """Each step's latest loss (a redone step's last value: the run as it stands) against the
    uninterrupted run's; relative differences. A step without a row is reported missing."""
    latest = {r["step"]: r["loss"] for r in rows}
    diffs = [abs(latest[s] - want) / abs(want) for s, want in enumerate(reference, 1) if s in latest]
    missing = [s for s in range(1, len(reference) + 1) if s not in latest]
    worst = max(diffs, default=None)
    return {"steps_compared": len(diffs), "missing": missing[:10], "max_rel_diff": worst,
            "within_1e-4": worst is not None and worst <= tol and not missing}
