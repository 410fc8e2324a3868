"""The `elastron` command line. Subcommands import what they need lazily so `--help` stays instant."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


class CLIError(Exception):
    """An error to show as one line, with a non-zero exit."""


def _cmd_demo(args: argparse.Namespace) -> int:
    from api.demo import run_demo

    return run_demo(steps=args.steps, workers=args.workers, run_dir=args.run_dir, layout=args.layout,
                    json_path=args.json)


def _cmd_run(args: argparse.Namespace) -> int:
    from api.run import run_job

    return run_job(args.config, address=args.address, workers=args.workers, layout=args.layout, steps=args.steps,
                   run_dir=args.run_dir, settle_seconds=args.settle_seconds, json_path=args.json)


def _cmd_train(args: argparse.Namespace) -> int:
    from service.server.driver import check_local_job, run_local

    # Fail fast, with one line, before starting any rank: the checks every rank would make.
    check_local_job(args.config, nproc=args.nproc, layout=args.layout, steps=args.steps, run_dir=args.run_dir)
    return run_local(args.config, nproc=args.nproc, run_dir=args.run_dir, layout=args.layout, steps=args.steps)


def _cmd_ckpt_inspect(args: argparse.Namespace) -> int:
    from service.server.tools import inspect_checkpoint

    info = inspect_checkpoint(args.path)
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    else:
        from api.render import table

        print(f"checkpoint {args.path}")
        for key in ("step", "layout", "format_version"):
            if key in info:
                print(f"  {key}: {info[key]}")
        tensors = info.get("tensors", {})
        if tensors:
            rows = [(name, "x".join(map(str, t["shape"])), t["dtype"]) for name, t in sorted(tensors.items())]
            print(table(["tensor", "global shape", "dtype"], rows))
        files = info.get("files", {})
        total = sum(f.get("size", 0) for f in files.values())
        algos = sorted({f.get("algorithm", "?") for f in files.values()})
        print(f"  files: {len(files)}, {total / 2**20:.1f} MiB, checksums: {', '.join(algos) or '-'}")
        print("  valid: yes" if info.get("valid") else "  valid: NO — " + "; ".join(info.get("problems", [])))
    if info.get("valid"):
        return 0
    problems = info.get("problems") or ["unknown problem"]
    more = f" (+{len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    print(f"elastron: error: checkpoint {info['path']} cannot be loaded: {problems[0]}{more}; a resumed run "
          "skips it and falls back to an older checkpoint", file=sys.stderr)
    return 1


def _cmd_export(args: argparse.Namespace) -> int:
    from service.server.tools import export_checkpoint

    out = export_checkpoint(args.path, args.out, overwrite=args.overwrite, dtype=args.dtype,
                            max_shard_size=args.max_shard_size)
    print(f"wrote Hugging Face Llama checkpoint to {out}")
    return 0


def _cmd_data_prepare(args: argparse.Namespace) -> int:
    from service.server.tools import prepare_data

    def progress(done: int, total: int) -> None:
        width = 30
        bar = "#" * (width * done // max(1, total))
        print(f"\rtokenising [{bar:<{width}}] {_size(done)} of {_size(total)}", end="" if done < total else "\n",
              file=sys.stderr, flush=True)

    meta = prepare_data(args.inputs, args.out, tokenizer=args.tokenizer, text_field=args.text_field,
                        val_fraction=args.val_fraction, seed=args.seed, progress=progress, add_bos=args.add_bos)
    out = Path(args.out)
    print(f"wrote {meta['tokens']['train']:,} training tokens ({meta['documents']['train']:,} documents) to "
          f"{out / 'train.bin'} and {meta['tokens']['val']:,} validation tokens to {out / 'val.bin'} "
          f"({meta['dtype']}, vocab {meta['vocab_size']:,}); use data: {{source: tokens, path: "
          f"{(out / 'train.bin').resolve()}, token_dtype: {meta['dtype']}}}")
    return 0


def _size(n: int) -> str:
    """Bytes as a person reads them: 812 B, 3.4 KiB, 1.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"


def _cmd_serve(args: argparse.Namespace) -> int:
    from api.app import serve

    return serve(args.address, args.host, args.port, store=args.store, insecure=args.insecure,
                 tls_cert=args.tls_cert, tls_key=args.tls_key)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="elastron", description="Elastic 3D-parallel LLM training on Ray.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="an elastic run on simulated nodes: preemption notice, node kill, regrowth")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--workers", type=int, default=4, help="simulated 1-CPU nodes (default 4)")
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help="metrics, events, checkpoints (default: a new temporary directory)")
    p.add_argument("--json", help="also write the summary as JSON to this path")
    p.set_defaults(fn=_cmd_demo)

    p = sub.add_parser("run", help="run a job through the elastic coordinator on Ray")
    p.add_argument("config", help="job config YAML")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--workers", type=int, help="run on at most this many workers")
    g.add_argument("--layout", help="force a layout, e.g. dp=2,tp=1,pp=2")
    p.add_argument("--steps", type=int, help="total optimizer steps (default: train.steps)")
    p.add_argument("--run-dir", help="metrics, events and checkpoints (default: runs/NAME)")
    p.add_argument("--settle-seconds", type=float, default=10.0, help="stable capacity needed before growing")
    p.add_argument("--json", help="write the final status and reconfigurations as JSON here")
    p.set_defaults(fn=_cmd_run)

    p = sub.add_parser("train", help="run a job on local ranks (torchrun-style, no Ray)")
    p.add_argument("config")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--layout")
    p.add_argument("--steps", type=int)
    p.add_argument("--run-dir", required=True)
    p.set_defaults(fn=_cmd_train)

    p = sub.add_parser("ckpt", help="checkpoint tools")
    csub = p.add_subparsers(dest="ckpt_command", required=True)
    q = csub.add_parser("inspect", help="show a checkpoint's step, layout, tensors and validity")
    q.add_argument("path")
    q.add_argument("--json", action="store_true")
    q.set_defaults(fn=_cmd_ckpt_inspect)

    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face Llama model (model.safetensors)")
    p.add_argument("path")
    p.add_argument("out")
    p.add_argument("--overwrite", action="store_true", help="replace the files a previous export wrote there")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="weights' dtype (default: the source model's, else float32)")
    p.add_argument("--max-shard-size", help="split the weights into files of at most this size (e.g. 2GB, 500MB), "
                                           "with an index")
    p.set_defaults(fn=_cmd_export)

    p = sub.add_parser("data", help="data tools")
    dsub = p.add_subparsers(dest="data_command", required=True)
    q = dsub.add_parser("prepare", help="tokenise text/JSONL/Parquet files into the token files jobs train on")
    q.add_argument("inputs", nargs="+", help="files or directories (.txt, .md, .jsonl, .parquet)")
    q.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a model directory holding one")
    q.add_argument("--out", required=True, help="directory for train.bin, val.bin and meta.json")
    q.add_argument("--text-field", default="text", help="JSONL key / Parquet column holding the text")
    q.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out (default 0.01)")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=None,
                   help="put the tokenizer's BOS token before every document (default: as its "
                        "tokenizer_config.json's add_bos_token says)")
    q.set_defaults(fn=_cmd_data_prepare)

    from api.cli_client import add_client_commands

    add_client_commands(sub)  # submit, jobs, status, events, resize, pause, resume, stop
    p = sub.add_parser("serve", help="run the job control API and dashboard (jobs run on Ray)")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a private local Ray)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--store", help="job store: a SQLAlchemy URL (sqlite:///PATH, postgresql+psycopg://USER:PASSWORD@"
                                   "HOST/DB) or a SQLite file path (default: ELASTRON_STORE, else RUNS_ROOT/elastron.db)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without ELASTRON_API_TOKEN (anyone who reaches it controls jobs)")
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM); needs --tls-key")
    p.add_argument("--tls-key", help="private key (PEM) of --tls-cert")
    p.set_defaults(fn=_cmd_serve)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (CLIError, ValueError, OSError) as e:
        # ConfigError, PlanError and CheckpointError are ValueError/RuntimeError subclasses with clear text;
        # OSError: a path that is missing, not a directory, not writable, ...
        print(f"elastron: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"elastron: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
