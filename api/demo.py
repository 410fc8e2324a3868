"""`elastron demo`: the tiny model on the Python standard library's source, on local ranks.

The embedded default needs nothing but this machine: the corpus is the stdlib that ships with Python.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import yaml

from api.render import line_chart, table
from workers.config import JobConfig

DEMO_CONFIG = {
    "name": "demo",
    "model": {"preset": "tiny"},
    "data": {"source": "corpus", "seq_len": 64, "max_bytes": 2_000_000},
    "train": {"steps": 40, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3, "warmup_steps": 4},
    "parallel": {"min_workers": 1, "max_workers": 4},
    "checkpoint": {"interval_steps": 10},
}


def run_demo(*, steps: int = 40, workers: int = 2, run_dir: str | None = None, layout: str | None = None,
             json_path: str | None = None) -> int:
    from workers.local import launch_local

    if steps < 1 or workers < 1:
        raise ValueError(f"--steps and --workers must be >= 1, got steps={steps}, workers={workers}")
    cfg_dict = json.loads(json.dumps(DEMO_CONFIG))
    cfg_dict["train"]["steps"] = steps
    JobConfig.from_dict(cfg_dict)  # validate before launching anything
    rd = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="elastron-demo-"))
    rd.mkdir(parents=True, exist_ok=True)
    cfg_path = rd / "job.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg_dict, sort_keys=False))
    print(f"elastron demo: tiny model, {workers} local rank(s), {steps} steps, run dir {rd}", flush=True)
    t0 = time.time()
    code = launch_local(cfg_path, nproc=workers, run_dir=rd, layout=layout, steps=steps)
    if code:
        print(f"elastron demo: a rank exited with code {code}")
        return code
    metrics = [json.loads(line) for line in (rd / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [m["loss"] for m in metrics]
    print()
    print(line_chart(losses, label="loss"))
    last = metrics[-1]
    summary = {
        "steps": last["step"], "first_loss": losses[0], "last_loss": losses[-1], "layout": last["layout"],
        "world_size": last["world_size"], "tokens": last["tokens"], "wall_s": round(time.time() - t0, 1),
        "run_dir": str(rd),
    }
    print()
    print(table(["steps", "layout", "loss first -> last", "tokens", "wall s"],
                [(summary["steps"], _layout_text(last["layout"]), f"{losses[0]:.3f} -> {losses[-1]:.3f}",
                  summary["tokens"], summary["wall_s"])]))
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=2))
    return 0


def _layout_text(d: dict) -> str:
    from parallel.layout import Layout

    return str(Layout.from_dict(d))
