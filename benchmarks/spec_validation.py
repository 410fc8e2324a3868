"""How long the REST API's spec check (`service.server.specs.validate_spec`) takes, for a typical spec and
for specs with every size at its limit (the spec schema's maxima: `workers.config.spec_maxima`).

    .venv/bin/python benchmarks/spec_validation.py [--runs 50] [--profile NAME] [--json out.json]

Specs (each is also what `--profile` takes):
  typical      examples/tiny.yaml.
  at_limit     every size at its schema maximum (model overrides but head_size and sliding_window, data, train, checkpoint, resources,
               max_workers, max_tp, max_pp, gpus_per_node, memory_budget_gb), 64 data suffixes, a 128-character
               name; tp and pp left to the planner, min_workers 1 (100,000 splits into no layout:
               5**5 workers would need pp 3125 > 1024 layers). Accepted.
  forced_pp    at_limit with parallel.pp: 5 (a degree that divides few of the counts on offer). Accepted.
  no_fit       at_limit with memory_budget_gb: 1: nothing fits, so the planner judges its most counts
               before refusing (a 422).
  no_fit_composite  no_fit with the sizes of most divisors under the limits (global batch 14414400,
               max_workers 98280, 960 heads), so each count splits in the most ways. Refused.

The runs interleave the specs (one of each per round), so a busy machine slows them alike. Prints the
median and the largest time per spec in ms, and whether it was accepted or the start of its message.
"""

from __future__ import annotations

import argparse
import cProfile
import copy
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from service.server.specs import SpecError, validate_spec  # noqa: E402
from workers.config import MAX_LIST, MAX_NAME, spec_maxima  # noqa: E402


def sizes() -> dict[tuple[str, str], int | float]:
    """(section, field) -> its largest value, for the sizes of every section: the integers and the memory
    budget (a model's under "model": its overrides but head_size and sliding_window)."""
    out: dict[tuple[str, str], int | float] = {}
    for path, v in spec_maxima().items():
        if path[:2] == ("model", "overrides") and isinstance(v, int) and path[2] not in ("head_size", "sliding_window"):
            out["model", path[2]] = v
        elif len(path) == 2 and path[0] in ("data", "train", "parallel", "checkpoint", "resources") and (
                isinstance(v, int) or path == ("parallel", "memory_budget_gb")):
            out[path] = v
    return out


def at_limit() -> dict:
    """Every size at its bound, in a spec the server accepts (tp and pp are the planner's)."""
    section = {s: {name: v for (sec, name), v in sizes().items() if sec == s}
               for s in ("model", "data", "train", "parallel", "checkpoint", "resources")}
    parallel = {k: v for k, v in section["parallel"].items() if k not in ("tp", "pp", "min_workers")}
    return {"name": "n" * MAX_NAME, "model": {"preset": "tiny", "overrides": section["model"]},
            "data": {**section["data"], "source": "synthetic", "suffixes": [f".s{i:03d}" for i in range(MAX_LIST)]},
            "train": section["train"], "parallel": {"min_workers": 1, **parallel},
            "checkpoint": section["checkpoint"], "resources": section["resources"]}


def specs() -> dict[str, dict]:
    typical = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    limit = at_limit()
    forced_pp = copy.deepcopy(limit)
    forced_pp["parallel"]["pp"] = 5
    no_fit = copy.deepcopy(limit)
    no_fit["parallel"]["memory_budget_gb"] = 1
    composite = copy.deepcopy(no_fit)
    composite["train"].update(global_batch_size=14414400, micro_batch_size=14414400)
    composite["parallel"].update(max_workers=98280, gpus_per_node=98280)
    composite["model"]["overrides"].update(dim=61440, n_heads=960, n_kv_heads=960, vocab_size=4147200,
                                           ffn_hidden=259200)
    return {"typical": typical, "at_limit": limit, "forced_pp": forced_pp, "no_fit": no_fit,
            "no_fit_composite": composite}


def outcome(spec: dict) -> str:
    try:
        validate_spec(spec)
    except SpecError as e:
        return f"422 at {'.'.join(map(str, e.loc))}: {e.msg[:70]}..."
    return "accepted"


def measure(all_specs: dict[str, dict], runs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in all_specs}
    for _ in range(runs):
        for name, spec in all_specs.items():
            t0 = time.perf_counter()
            try:
                validate_spec(spec)
            except SpecError:
                pass
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--profile", choices=list(specs()), help="also print cProfile's top functions for this spec")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    all_specs = specs()
    results = {name: outcome(spec) for name, spec in all_specs.items()}  # also warms imports and caches
    times = measure(all_specs, args.runs)
    print(f"validate_spec, {args.runs} runs each (ms)")
    print(f"{'spec':<18} {'median':>8} {'max':>8}  result")
    for name, ts in times.items():
        print(f"{name:<18} {statistics.median(ts):8.2f} {max(ts):8.2f}  {results[name]}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        outcome(all_specs[args.profile])
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    if args.json:
        args.json.write_text(json.dumps({name: {"median_ms": statistics.median(ts), "max_ms": max(ts),
                                                "result": results[name]} for name, ts in times.items()}, indent=1))


if __name__ == "__main__":
    main()
