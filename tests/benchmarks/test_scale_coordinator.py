"""`benchmarks/scale.py coordinator` at a small size: every event kind runs to its end and is carried out
by the group call it names (the benchmark measures what it says it does)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _scale():
    spec = importlib.util.spec_from_file_location("scale_bench", ROOT / "benchmarks" / "scale.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_event_kind_ends_running_its_new_plan_carried_out_by_one_group_call():
    rows = {r["event"]: r for r in _scale().coordinator_run(64, "replicate", profile=False)["events"]}

    assert list(rows) == ["start", "drain", "join", "resize", "kill", "kill_snapshots", "kill_uncovered",
                         "takeover"]
    assert all(r["done"] and r["state"] == "RUNNING" for r in rows.values())
    assert {k: r["carried_out_by"] for k, r in rows.items()} == {
        "start": "form", "drain": "reshard", "join": "reshard", "resize": "reshard", "kill": "reshard",
        "kill_snapshots": "reshard", "kill_uncovered": "form", "takeover": "carry_on"}
    assert {k: r["world"] for k, r in rows.items()} == {
        "start": 64, "drain": 56, "join": 64, "resize": 48, "kill": 48, "kill_snapshots": 48, "kill_uncovered": 40,
        "takeover": 40}
    # the failure path asks every survivor in one call, and heals the group from their state
    assert {k: r["moved_from"] for k, r in rows.items()} == {
        "start": None, "drain": "the sound group", "join": "the sound group", "resize": "the sound group",
        "kill": "survivors' live state", "kill_snapshots": "peer snapshots", "kill_uncovered": None,
        "takeover": None}
    assert all(rows[k]["group_calls"]["salvage"] == 1 for k in ("kill", "kill_snapshots", "kill_uncovered"))
    assert all(r["coordinator_s"] >= 0 and r["decision_to_call_s"] >= 0 for r in rows.values())
