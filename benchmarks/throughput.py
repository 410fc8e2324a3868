"""Training throughput on CPU: Elastron's Trainer against plain PyTorch loops of the same model, side by side.

    cd /work/main && .venv/bin/python benchmarks/throughput.py [--steps 3] [--reps 12] [--warmup 3]
        [--no-phases] [--only ws1|ws2] [--variants ddp,default,...] [--json out.json] [--dim 256 --n-layers 4 ... (model overrides)]

Same model (the `small` preset shrunk to dim 256, 4 layers, 4 heads / 2 KV heads, FFN 704: 3.1M
parameters, vocabulary 256), same data (synthetic tokens, seq_len 128), global batch 8, micro batch 2,
AdamW (foreach) with grad clipping at 1.0, fp32, constant LR, for every variant:

  world size 1 (one spawned gloo rank):
    plain             `models.llama.Transformer` built on CPU, weights from `init_value`, micro-batched
                      forward / cross-entropy / backward, `clip_grad_norm_`, `AdamW.step`; its batches are
                      prepared before timing (it pays nothing for data)
    elastron          `Trainer.train_step()`, no run_dir (no metrics file, no checkpoints)   target >= 0.95x
    elastron+metrics  with a run_dir: metrics.jsonl on rank 0, no checkpoint within the run
    elastron+ckpt     with a run_dir and an async checkpoint every `--ckpt-interval` steps (default
                      `--steps`: one per timed block, far more often than a real job)
  world size 2 (two spawned gloo ranks):
    ddp               torchrun-style `DistributedDataParallel` (defaults; `no_sync()` on all but the last
                      micro-batch), each rank its half of the global batch
    fsdp              Elastron dp_shard=2 (FSDP2)                                            target >= 0.95x
    replicate         Elastron dp_replicate=2 (fp32, so DDP via composable `replicate()`)    target >= 0.95x
    tp, pp            Elastron tp=2 and pp=2 (1F1B), for information (ratios to ddp)
    default           Elastron under the layout the planner picks for 2 CPU ranks from the job config
                      (`job_plan`; with parallel.dp_mode auto: dp_replicate=2)                target >= 0.95x

Every rank runs with OMP_NUM_THREADS=1 (tests.multiproc.run_ranks), so a world-size-2 run uses both
cores. All variants of a world size live in the same process(es) and consume the same global batches;
their losses are checked against each other. After `--warmup` steps each, every variant runs `--reps`
blocks of `--steps` steps, each block next to one of its baseline's (plain or ddp): A, B, A, C, A, D, ...,
backwards on every other repetition, so drift on a shared box hits all of them. A block is timed from
a barrier to a barrier (wall: max over ranks; CPU: process time of all threads, summed over ranks).
Reported per variant: median tokens/s and the ratio of medians to the baseline (the target); the median
of the paired ratios (each block against the baseline block(s) next to it); and CPU seconds per step,
which time spent descheduled on a loaded box does not inflate. Then, per Elastron variant, where a
step's time goes, from one extra untimed block with the trainer's callees wrapped (not changed).
Prints a markdown table and JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = 0.95
WS1 = ("plain", "elastron", "elastron+metrics", "elastron+ckpt")
WS2 = ("ddp", "default", "fsdp", "replicate", "tp", "pp")
LAYOUTS = {"fsdp": "dp_shard=2", "replicate": "dp_replicate=2", "tp": "tp=2", "pp": "pp=2"}
BASELINE = {"elastron": "plain", "elastron+metrics": "plain", "elastron+ckpt": "plain",
            "fsdp": "ddp", "replicate": "ddp", "tp": "ddp", "pp": "ddp", "default": "ddp"}
TARGETED = ("elastron", "fsdp", "replicate", "default")


def _cfg(a: argparse.Namespace, *, ckpt_dir: str | None = None, ckpt_interval: int = 1_000_000) -> dict:
    overrides = {k: v for k, v in (("dim", a.dim), ("n_layers", a.n_layers), ("n_heads", a.n_heads),
                                   ("n_kv_heads", a.n_kv_heads), ("ffn_hidden", a.ffn_hidden)) if v is not None}
    return {
        "model": {"preset": a.preset, "overrides": overrides},
        "data": {"source": "synthetic", "seq_len": a.seq_len, "num_samples": 100_000},
        "train": {"steps": 1_000_000, "global_batch_size": a.global_batch, "micro_batch_size": a.micro_batch,
                  "lr": 1e-3, "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0},
        "parallel": {"pp_schedule": "1f1b"},
        "checkpoint": {"interval_steps": ckpt_interval, "keep_last": 2, "async_save": True,
                       "dir": ckpt_dir},
    }


# -- runners: one object per variant, `step()` = one optimizer step ------------------------------------

class PlainLoop:
    """The reference: what a user would write by hand for one rank (optionally wrapped in DDP)."""

    def __init__(self, cfg, batches: list, *, ddp: bool) -> None:
        import torch
        from torch import nn

        from models.llama import Transformer, init_value

        self.torch, self.nn = torch, nn
        mc, t = cfg.model.build(), cfg.train
        model = Transformer(mc)  # CPU, uninitialised storage
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init_value(mc, name, tuple(p.shape), t.seed))
        model.init_buffers("cpu")
        self.params = list(model.parameters())
        self.model = nn.parallel.DistributedDataParallel(model) if ddp else model
        self.ddp = ddp
        self.opt = torch.optim.AdamW(self.params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                     weight_decay=t.weight_decay, foreach=True)
        self.clip = t.grad_clip
        self.batches = batches
        self.losses: list = []  # local mean loss per step (tensors; read after timing)

    def step(self) -> None:
        torch, F = self.torch, self.nn.functional
        inputs, targets = self.batches[len(self.losses)]
        n = len(inputs)
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for i, (x, y) in enumerate(zip(inputs, targets)):
            sync = self.model.no_sync() if self.ddp and i < n - 1 else contextlib.nullcontext()
            with sync:
                loss = F.cross_entropy(self.model(x).flatten(0, 1).float(), y.flatten(0, 1))
                (loss / n).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.opt.step()
        self.losses.append(total / n)

    def close(self) -> None:
        pass


class ElastronLoop:
    """Elastron as a job runs it: `Trainer.build()` under a layout, then `train_step()`."""

    def __init__(self, cfg, layout: str, run_dir: str | None) -> None:
        import torch

        from parallel.layout import Layout
        from workers.trainer import Trainer

        self.trainer = Trainer(cfg, layout=Layout.parse(layout), device=torch.device("cpu"),
                               run_dir=run_dir).build()
        self.losses: list[float] = []

    def step(self) -> None:
        self.losses.append(self.trainer.train_step().loss)

    def close(self) -> None:
        self.trainer.close()


def _batches(cfg, *, dp_rank: int, dp: int, n: int) -> list:
    """The first `n` batches the Trainer's loader will give this DP rank, prepared up front."""
    from workers.data import DataLoader, build_source

    t = cfg.train
    source = build_source(cfg.data, seed=t.seed, vocab_size=cfg.model.build().vocab_size)
    loader = DataLoader(source, seed=t.seed, global_batch_size=t.global_batch_size,
                        micro_batch_size=t.micro_batch_size, dp_rank=dp_rank, dp_size=dp)
    return [(b.inputs, b.targets) for b in (loader.next_batch() for _ in range(n))]


# -- phases: where an Elastron step's time goes ----------------------------------------------------------

def _measure_phases(runner: ElastronLoop, n: int) -> dict[str, float]:
    """Mean ms per step in each of the Trainer's `PHASES` (data with the LR update, forward+backward with
    zero_grad, grad clip, optimizer, loss all-reduce with its .item()), and the rest (metrics, periodic
    checkpoint): extra steps, timed through the Trainer's `phase_times` seam."""
    import torch.distributed as dist

    trainer = runner.trainer
    trainer.phase_times = {}
    try:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            runner.step()
        total = time.perf_counter() - t0
        out = {k: 1e3 * v / n for k, v in trainer.phase_times.items()}
    finally:
        trainer.phase_times = None
    out["other"] = 1e3 * total / n - sum(out.values())
    out["step"] = 1e3 * total / n
    return out


# -- the rank body ---------------------------------------------------------------------------------------

def _body(args: dict, variants: tuple[str, ...]) -> dict:
    import torch
    import torch.distributed as dist

    from workers.config import JobConfig

    a = argparse.Namespace(**args)
    ws, rank = dist.get_world_size(), dist.get_rank()
    # batches the baseline (variants[0]) needs: it runs one block next to each other variant's, per rep
    total_steps = a.warmup + a.reps * a.steps * (len(variants) - 1)
    tmp = tempfile.mkdtemp(prefix="elastron-tput-") if rank == 0 else None
    obj = [tmp]
    dist.broadcast_object_list(obj)
    tmp = obj[0]

    runners: dict[str, Any] = {}
    for v in variants:
        if v in ("plain", "ddp"):
            cfg = JobConfig.from_dict(_cfg(a))
            dp_rank, dp = (rank, ws) if v == "ddp" else (0, 1)
            runners[v] = PlainLoop(cfg, _batches(cfg, dp_rank=dp_rank, dp=dp, n=total_steps), ddp=v == "ddp")
        elif v in ("elastron+metrics", "elastron+ckpt"):
            run_dir = os.path.join(tmp, v)
            every = (a.ckpt_interval or a.steps) if v == "elastron+ckpt" else 1_000_000
            ckpt_dir = os.path.join(run_dir, "checkpoints")
            cfg = JobConfig.from_dict(_cfg(a, ckpt_dir=ckpt_dir, ckpt_interval=every))
            runners[v] = ElastronLoop(cfg, "dp=1", run_dir)
        elif v == "default":
            from workers.config import job_plan

            cfg = JobConfig.from_dict(_cfg(a))
            lay = str(job_plan(cfg, ws, device_type="cpu").layout)
            if rank == 0:
                print(f"default: the planner's layout for {ws} CPU ranks is {lay}", file=sys.stderr, flush=True)
            runners[v] = ElastronLoop(cfg, lay, None)
        else:
            cfg = JobConfig.from_dict(_cfg(a))
            runners[v] = ElastronLoop(cfg, LAYOUTS.get(v, "dp=1"), None)

    def block(runner, n: int) -> tuple[float, float]:
        """(wall seconds, max over ranks; CPU seconds of all threads, summed over ranks)."""
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            runner.step()
        dist.barrier()
        wall = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        cpu = torch.tensor(time.process_time() - c0, dtype=torch.float64)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
        dist.all_reduce(cpu)
        return float(wall), float(cpu)

    for v in variants:
        block(runners[v], a.warmup)
    # A, B, A, C, A, D, ...: every block of a variant sits next to a block of its baseline (variants[0]);
    # odd repetitions run the sequence backwards, so no variant always follows the same neighbour.
    base, others = variants[0], variants[1:]
    order = [x for v in others for x in (base, v)]
    seq: list[tuple[str, float, float]] = []  # (variant, wall s, CPU s) in the order run
    load = [os.getloadavg()[0]]
    for r in range(a.reps):
        for v in (order if r % 2 == 0 else order[::-1]):
            seq.append((v, *block(runners[v], a.steps)))
        load.append(os.getloadavg()[0])
    phases = {}
    if a.phases:
        for v in variants:
            if isinstance(runners[v], ElastronLoop):
                phases[v] = _measure_phases(runners[v], a.steps)

    losses = {}
    for v in variants:
        r_ = runners[v]
        if isinstance(r_, PlainLoop):
            ls = torch.stack(r_.losses).double()
            dist.all_reduce(ls)  # every variant reports the mean over the global batch
            losses[v] = (ls / ws).tolist() if v == "ddp" else ls.tolist()  # plain: ws == 1
        else:
            losses[v] = r_.losses
        r_.close()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"seq": seq, "losses": losses, "phases": phases, "load": load, "rank": rank}


# -- report ----------------------------------------------------------------------------------------------

def _paired(seq: list[tuple[str, float, float]], v: str, base: str) -> list[float]:
    """Per block of `v`: baseline wall time of the neighbouring baseline block(s) / the block's wall time."""
    out = []
    for i, (name, wall, _) in enumerate(seq):
        if name != v:
            continue
        near = [seq[j][1] for j in (i - 1, i + 1) if 0 <= j < len(seq) and seq[j][0] == base]
        if near:
            out.append(statistics.fmean(near) / wall)
    return out


def _summarise(res: dict, variants: tuple[str, ...], tokens_per_step: int, steps: int) -> dict:
    out = {}
    for v in variants:
        walls = [w for name, w, _ in res["seq"] if name == v]
        cpus = [c for name, _, c in res["seq"] if name == v]
        tps = [tokens_per_step * steps / w for w in walls]
        out[v] = {"blocks": len(walls), "tokens_per_s": [round(x, 1) for x in tps],
                  "median_tokens_per_s": statistics.median(tps), "median_step_s": statistics.median(walls) / steps,
                  "median_cpu_s_per_step": statistics.median(cpus) / steps}
    for v in variants:
        base = BASELINE.get(v)
        if base in out:
            o, b = out[v], out[base]
            o["baseline"] = base
            o["ratio"] = o["median_tokens_per_s"] / b["median_tokens_per_s"]
            # Against the baseline blocks run right before/after: cancels drift slower than a block.
            o["paired_ratio"] = statistics.median(_paired(res["seq"], v, base))
            # CPU seconds (all ranks) per step: not inflated by time spent descheduled on a loaded box.
            o["cpu_ratio"] = b["median_cpu_s_per_step"] / o["median_cpu_s_per_step"]
            if v in TARGETED:
                o["target"] = TARGET
                o["met"] = o["ratio"] >= TARGET
                o["met_by_paired_and_cpu"] = o["paired_ratio"] >= TARGET and o["cpu_ratio"] >= TARGET
        ref = res["losses"][base if base in res["losses"] else v]
        mine = res["losses"][v]
        out[v]["max_loss_rel_diff_vs_baseline"] = max(abs(x - y) / abs(y) for x, y in zip(mine, ref))
        out[v]["final_loss"] = mine[-1]
    return out


LABELS = {
    "plain": "plain PyTorch loop (1 rank)", "elastron": "Elastron Trainer, no run_dir",
    "elastron+metrics": "Elastron Trainer, run_dir (metrics.jsonl)",
    "elastron+ckpt": "Elastron Trainer, run_dir (metrics + async ckpt every block)",
    "ddp": "DDP, 2 gloo ranks (torchrun-style)", "fsdp": "Elastron dp_shard=2 (FSDP2)",
    "replicate": "Elastron dp_replicate=2 (DDP)", "tp": "Elastron tp=2", "pp": "Elastron pp=2 (1F1B)",
    "default": "Elastron, the planner's default layout",
}


def _table(summary: dict[str, dict]) -> str:
    rows = ["| world | variant | step (s) | tokens/s (median) | vs | ratio of medians | paired ratio | "
            "CPU s/step (all ranks) | CPU ratio | target | met |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for v, s in summary.items():
        ws = 1 if v in WS1 else 2
        f = lambda k: f"{s[k]:.3f}" if k in s else "—"  # noqa: E731
        target = f">= {s['target']:.2f}" if "target" in s else "info"
        met = ("yes" if s["met"] else "**no**") if "met" in s else "—"
        rows.append(f"| {ws} | {LABELS[v]} | {s['median_step_s']:.3f} | {s['median_tokens_per_s']:.0f} | "
                    f"{s.get('baseline', '—')} | {f('ratio')} | {f('paired_ratio')} | "
                    f"{s['median_cpu_s_per_step']:.3f} | {f('cpu_ratio')} | {target} | {met} |")
    return "\n".join(rows)


def _phase_table(phases: dict[str, dict[str, float]]) -> str:
    if not phases:
        return ""
    cols = ["data", "forward+backward", "grad clip", "optimizer", "loss all_reduce", "other", "step"]
    rows = ["| variant | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for v, p in phases.items():
        rows.append(f"| {v} | " + " | ".join(f"{p.get(c, 0.0):.1f}" for c in cols) + " |")
    return "ms per step (mean of one extra block, rank 0):\n\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-kv-heads", type=int, default=2)
    p.add_argument("--ffn-hidden", type=int, default=704)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--reps", type=int, default=12, help="timed blocks per variant (interleaved)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ckpt-interval", type=int, default=None,
                   help="elastron+run: checkpoint every N steps (default --steps: one per block)")
    p.add_argument("--no-phases", dest="phases", action="store_false",
                   help="skip the per-phase breakdown of Elastron steps (one extra untimed block each)")
    p.add_argument("--only", choices=("ws1", "ws2"), default=None)
    p.add_argument("--variants", default=None,
                   help="comma-separated subset of the variants (each world size keeps its baseline first)")
    p.add_argument("--json", default=None, help="also write the JSON here")
    a = p.parse_args(argv)

    from tests.multiproc import run_ranks
    from workers.config import JobConfig

    cfg = JobConfig.from_dict(_cfg(a))
    mc = cfg.model.build()
    tokens_per_step = a.global_batch * a.seq_len
    timeout = 3600.0
    load0 = os.getloadavg()
    summary: dict[str, dict] = {}
    phases: dict[str, dict] = {}
    loads: list[float] = []
    t_start = time.time()
    for ws, variants in ((1, WS1), (2, WS2)):
        if a.only and a.only != f"ws{ws}":
            continue
        if a.variants:
            keep = set(a.variants.split(","))
            variants = tuple(v for i, v in enumerate(variants) if i == 0 or v in keep)
            if len(variants) == 1:
                continue
        print(f"world size {ws}: {', '.join(variants)} ...", file=sys.stderr, flush=True)
        res = run_ranks(ws, _body, vars(a), variants, timeout=timeout, spawn=True)[0]
        summary.update(_summarise(res, variants, tokens_per_step, a.steps))
        phases.update(res["phases"])
        loads += res["load"]

    import torch

    out = {
        "benchmark": "training throughput (CPU)",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
                    "omp_num_threads_per_rank": 1,
                    "loadavg_1m_before": load0[0], "loadavg_1m_during": [round(x, 2) for x in loads],
                    "loadavg_1m_after": os.getloadavg()[0]},
        "setup": {"model": {"preset": a.preset, **mc.to_dict(),
                            "params": mc.num_params()},
                  "seq_len": a.seq_len, "global_batch": a.global_batch, "micro_batch": a.micro_batch,
                  "tokens_per_step": tokens_per_step, "steps_per_block": a.steps, "reps": a.reps,
                  "warmup": a.warmup, "ckpt_interval_elastron_ckpt": a.ckpt_interval or a.steps,
                  "wall_s": round(time.time() - t_start, 1)},
        "results": summary,
        "phases_ms": phases,
    }
    print(_table(summary))
    for v, s in summary.items():
        if "met" in s and s["met"] != s["met_by_paired_and_cpu"]:
            print(f"\nnote: {v}: the ratio of medians ({s['ratio']:.3f}) says {'met' if s['met'] else 'missed'}, "
                  f"the paired ({s['paired_ratio']:.3f}) and CPU ({s['cpu_ratio']:.3f}) ratios do not agree: "
                  "the box was too noisy to decide from wall time; rerun or trust the CPU ratio")
    if phases:
        print()
        print(_phase_table(phases))
    worst = max(summary.items(), key=lambda kv: kv[1]["max_loss_rel_diff_vs_baseline"])
    print(f"\nlosses: every variant within {worst[1]['max_loss_rel_diff_vs_baseline']:.1e} (relative, "
          f"{worst[0]}) of its baseline's, step by step")
    print(f"load average (1 min) before {load0[0]:.2f}, during {min(loads):.2f}-{max(loads):.2f}")
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
