"""Rank entry point, for torchrun and for debugging:

    torchrun --nproc_per_node N -m workers.train CONFIG --layout dp=..,tp=..,pp=.. --steps S --run-dir DIR

`--steps S` is the run's total number of optimizer steps and the length of its LR schedule (it replaces
train.steps; train.decay_steps, when set, still fixes where the decay ends). Every rank validates its input before joining
the process group, so a bad layout or config exits non-zero with one line instead of hanging the others.

A run resumes by itself: if the checkpoint directory (checkpoint.dir, else RUN_DIR/checkpoints) holds a
committed checkpoint, training continues from it under this invocation's layout, e.g. a run started
with `--layout tp=2 --steps 10` continues with `--layout dp=1 --steps 20 --run-dir` the same DIR.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import NoReturn

from parallel.checkpoint.errors import CheckpointError
from parallel.layout import Layout
from workers.config import ConfigError, job_plan, load_config, with_steps
from workers.preflight import preflight
from workers.run_dir import check_run_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m workers.train", description="Train one rank of an Elastron job.")
    ap.add_argument("config", help="job config YAML")
    ap.add_argument("--layout", help="e.g. dp=2,tp=1,pp=2 (product = number of ranks); default: planned")
    ap.add_argument("--steps", type=int, help="total optimizer steps of the run (default: train.steps)")
    ap.add_argument("--run-dir", required=True,
                    help="directory for metrics.jsonl and checkpoints; a run found there is resumed")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    # torch is imported here, not at module level: `elastron train` runs the checks above without it.
    from workers.runtime import destroy_process_group, env_world, init_process_group, pick_device

    args = parse_args(argv)
    rank, world_size = env_world()
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    try:
        checked = preflight(with_steps(load_config(args.config), args.steps))
        cfg = checked.cfg
        device = pick_device(cfg.resources.device)
        plan = job_plan(cfg, world_size, layout=args.layout, device_type=device.type)
        layout = plan.layout
        steps = cfg.train.steps
        if rank == 0:
            check_run_dir(cfg, args.run_dir)
            for w in checked.warnings:
                print(f"warning: {w}", file=sys.stderr, flush=True)
    except (ConfigError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from workers.trainer import Trainer

    init_process_group(device)
    trainer = None
    try:
        trainer = Trainer(cfg, plan=plan, device=device, run_dir=Path(args.run_dir)).build()
        if rank == 0 and trainer.resumed_from is not None:
            m = trainer.resumed_from
            print(f"resumed from {trainer.checkpoint_dir()} step {m.step} (saved under {_layout_text(m.layout)}, "
                  f"now {layout})", flush=True)
        elif rank == 0 and cfg.model.init_from is not None:
            print(f"started from {cfg.model.init_from} under {layout}", flush=True)

        def report(m):
            if rank == 0:
                val = f"  val_loss {m.val_loss:.4f}" if m.val_loss is not None else ""
                print(f"step {m.step:>5}  loss {m.loss:.4f}{val}  lr {m.lr:.2e}  {m.tokens_per_s:,.0f} tok/s  "
                      f"[{layout}]", flush=True)

        trainer.fit(steps, on_step=report)
    except CheckpointError as e:
        # Every rank reaches the same verdict on the checkpoints, so every rank exits here.
        print(f"error: {e}", file=sys.stderr)
        return 3
    except ConfigError as e:  # found while building (e.g. a corpus with too little text): the same on every rank
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        try:
            if trainer is not None:
                trainer.close()  # a save in flight commits (bounded wait), metrics sinks flush
        finally:
            destroy_process_group()
    return 0


def _layout_text(d: object) -> str:
    try:
        return str(Layout.from_dict(d))  # type: ignore[arg-type]
    except (TypeError, ValueError, AttributeError):
        return repr(d)


def _exit_without_teardown(code: int) -> NoReturn:
    """Leave with `code` once everything is written, without the interpreter's shutdown.

    Destroying the process groups only unregisters them: their gloo worker threads live on while anything
    refers to a group, and torch's DTensor caches keep the device meshes (which hold their groups) to the
    end. Such a thread drops its last reference to a finished collective a moment after the caller's wait
    returned; if that happens while the interpreter shuts down, freeing the collective's tensors wants the
    GIL, the thread is made to exit, and the C++ runtime aborts the process: "terminate called without an
    active exception", exit 250, after a run that trained and committed all its steps (1 in 20-25 runs of
    `elastron train --nproc 2`; core dump: a `ProcessGroupGloo::runLoop` thread in `~AsyncBroadcastWork`
    while the main thread is in `Py_FinalizeEx`). By here the trainer is closed (checkpoint committed,
    metrics sinks flushed), so only the streams and logging are left to flush."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _exit_without_teardown(main())  # an exception out of main() still takes the usual way out
