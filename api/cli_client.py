"""`elastron submit|jobs|status|resize|pause|resume|stop|events`: the job API from the command line.

Each command prints a result (tables where there are rows) and returns 0; an error from the server, or
a server that does not answer, is one line on stderr and exit 1; a job file that cannot be read is
exit 2. `--server` (or ELASTRON_SERVER, default http://127.0.0.1:8000) and `--token` (or
ELASTRON_API_TOKEN) pick the server and the bearer token.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from api.client import DEFAULT_SERVER, APIError, Client
from api.render import table
from service.control.commands import CommandError, Pause, Resume, SetWorkers, Stop


def _client(args: argparse.Namespace) -> Client:
    return Client(args.server, args.token)


def _fmt(v, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if digits == 0 or abs(v) >= 1e5 else f"{v:.{digits}g}"
    return str(v)


def _layout(j: dict) -> str:
    d = j.get("degrees")
    return f"dp={d['dp']} tp={d['tp']} pp={d['pp']}" if d else "-"


def _state(j: dict) -> str:
    """The state, with the place in the queue of a QUEUED job ("QUEUED #2")."""
    return f"{j['state']} #{j['queue_position']}" if j.get("queue_position") else j["state"]


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except APIError as e:
            print(f"elastron: error: {e}", file=sys.stderr)
            return 1
    run.__name__ = fn.__name__
    return run


@_guard
def cmd_submit(args: argparse.Namespace) -> int:
    import yaml

    try:
        with open(args.config) as f:
            spec = yaml.safe_load(f) or {}
    except OSError as e:
        print(f"elastron: error: cannot read {args.config}: {e.strerror}", file=sys.stderr)
        return 2
    except yaml.YAMLError as e:
        print(f"elastron: error: {args.config} is not valid YAML: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    with _client(args) as c:
        out = c.submit(spec, steps=args.steps, workers=args.workers, run_dir=args.run_dir)
    print(out["id"] if args.quiet else f"submitted job {out['id']} (run dir {out['run_dir']})")
    return 0


@_guard
def cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as c:
        jobs = c.jobs()
    if not jobs:
        print("no jobs")
        return 0
    rows = [(j["id"], j["name"], _state(j), j.get("priority", 0), f"{j.get('step') or 0}/{j.get('total_steps') or '?'}",
             _fmt(j.get("loss")), _fmt(j.get("tokens_per_s"), 0), j.get("world_size", 0), _layout(j)) for j in jobs]
    print(table(["id", "name", "state", "prio", "step", "loss", "tokens/s", "workers", "layout"], rows))
    return 0


@_guard
def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as c:
        j = c.job(args.id)
    rows = [
        ("state", _state(j)), ("reason", j.get("reason") or "-"), ("priority", j.get("priority", 0)),
        ("workers held", ", ".join(f"{n[:8]}:{k}" for n, k in sorted((j.get("held") or {}).items())) or "-"),
        ("step", f"{j.get('step') or 0}/{j.get('total_steps') or '?'}"), ("loss", _fmt(j.get("loss"))),
        ("tokens/s", _fmt(j.get("tokens_per_s"), 0)), ("layout", _layout(j)), ("world size", j.get("world_size", 0)),
        ("workers range", f"{j.get('min_workers', '-')}..{j.get('max_workers', '-')}"),
        ("checkpoint", f"step {j['committed_step']}" if j.get("committed_step") else "none yet"),
        ("reconfigurations", ", ".join(f"{k} {v}" for k, v in sorted((j.get("reconfigurations") or {}).items())) or "-"),
        ("steps lost", j.get("steps_lost", 0)), ("run dir", j.get("run_dir")),
    ]
    print(f"job {j['id']} ({j['name']})")
    print(table(["field", "value"], rows))
    return 0


@_guard
def cmd_events(args: argparse.Namespace) -> int:
    with _client(args) as c:
        events = c.events(args.id, args.since)
    rows = [(_when(e.get("time")), _fmt(e.get("step")), e["kind"],
             f"{e['from_state']} -> {e['to_state']}" if e["kind"] == "transition" else e.get("to_state") or "",
             e.get("cause") or "", e.get("reason", "")) for e in events]
    print(table(["time", "step", "kind", "state", "cause", "reason"], rows) if rows else "no events")
    return 0


@_guard
def cmd_resize(args: argparse.Namespace) -> int:
    if args.workers is None and args.min is None and args.max is None:
        print("elastron: error: give N (workers), or --min and/or --max", file=sys.stderr)
        return 2
    try:
        cmd = SetWorkers(workers=args.workers, min_workers=args.min, max_workers=args.max)
    except CommandError as e:
        print(f"elastron: error: {e}", file=sys.stderr)
        return 2
    with _client(args) as c:
        out = c.command(args.id, cmd)
    return _accepted(out)


def _action(cmd: Pause | Resume | Stop) -> Callable[[argparse.Namespace], int]:
    @_guard
    def run(args: argparse.Namespace) -> int:
        with _client(args) as c:
            out = c.command(args.id, cmd)
        return _accepted(out)
    return run


def _accepted(out: dict) -> int:
    print(f"{out['action']} of job {out['id']} accepted (it was {out['state']}); the coordinator applies it at "
          "its next iteration")
    return 0


def add_client_commands(sub: argparse._SubParsersAction) -> None:
    """Register the client subcommands on the `elastron` parser's subparsers; each sets fn(args) -> int."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--server", help=f"API server URL (default: ELASTRON_SERVER, else {DEFAULT_SERVER})")
    common.add_argument("--token", help="API bearer token (default: ELASTRON_API_TOKEN)")

    p = sub.add_parser("submit", parents=[common], help="submit a job YAML to the job server")
    p.add_argument("config", help="job config YAML")
    p.add_argument("--steps", type=int, help="total optimizer steps (default: train.steps)")
    p.add_argument("--workers", type=int, help="run on at most this many workers")
    p.add_argument("--run-dir", help="run directory, relative to the server's runs root")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the job id")
    p.set_defaults(fn=cmd_submit)

    p = sub.add_parser("jobs", parents=[common], help="list the server's jobs")
    p.set_defaults(fn=cmd_jobs)

    p = sub.add_parser("status", parents=[common], help="one job's state, layout, progress and reason")
    p.add_argument("id")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("events", parents=[common], help="one job's events (transitions, resizes, failures)")
    p.add_argument("id")
    p.add_argument("--since", type=int, default=0, help="first event index")
    p.set_defaults(fn=cmd_events)

    p = sub.add_parser("resize", parents=[common], help="run a job on N workers, or within --min..--max")
    p.add_argument("id")
    p.add_argument("workers", type=int, nargs="?", metavar="N")
    p.add_argument("--min", type=int, help="new min_workers")
    p.add_argument("--max", type=int, help="new max_workers")
    p.set_defaults(fn=cmd_resize)

    for cmd, text in ((Pause(), "checkpoint and release a job's workers (resume later)"),
                      (Resume(), "resume a paused job"), (Stop(), "stop a job for good (after a checkpoint)")):
        p = sub.add_parser(cmd.kind, parents=[common], help=text)
        p.add_argument("id")
        p.set_defaults(fn=_action(cmd))
