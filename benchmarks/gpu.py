"""Training throughput on one device: Elastron's Trainer against a hand-written PyTorch loop, side by side.

    .venv/bin/python benchmarks/gpu.py --device cuda --preset 1b [--seq-len 2048] [--micro-batches 4,8]
        [--compile no,yes] [--ac none] [--float8 none,tensorwise] [--layers 8] [--override vocab_size=128256]
        [--warmup 4] [--steps 9] [--profile] [--json out.json]
    .venv/bin/python benchmarks/gpu.py --device cpu --preset tiny          # CI-sized, well under a minute
    .venv/bin/python benchmarks/gpu.py --device cuda --preset 8b --layers 8 --loss-compare tensorwise \
        --data tokens/train.bin [--loss-steps 300] [--loss-window 50]    # float8 against bf16, real text

One process, dp=1. `--layers N` and `--override FIELD=VALUE` (repeatable, any `ModelConfig` field) change
the preset's shape, e.g. the 8b preset cut to 8 layers. For every setting (micro batch x compile x
activation checkpointing x float8 recipe) both loops train
the same model (same initial weights, `models.llama.init_value`) on the same batches (the Trainer's
synthetic data, recorded through its `on_batch` seam and replayed to the plain loop). By default on
CUDA one after the other, each freed before the next is built (two 1b loops with AdamW state do not fit
beside each other at every micro batch); with `--interleave` (the default on CPU, where a shared box's
load swings within seconds) both are built and their steps alternate, so both see the same load:

  elastron  `Trainer(layout=dp=1).build()`, then `train_step()`: for bf16 the model unwrapped, casting
            its fp32 weights at use (`parallel.precision`), its fused AdamW on local shards, its
            gradient clipping (the factor folded into the fused kernel) and its chunked loss
  plain     what one would write by hand: `Transformer` on the device, fp32 master weights,
            `torch.autocast` bf16 (when bf16), per-block `torch.compile` and `torch.utils.checkpoint`
            where the setting says so (the whole block recomputed for AC full and selective alike:
            selective's op policy is Elastron's own, so its rows compare it with full),
            `F.cross_entropy` on fp32 logits, `clip_grad_norm_(foreach)`, AdamW (fused on CUDA,
            foreach on CPU); under `--float8` its linear layers converted by the same torchao call
            (`parallel.float8.convert_float8`, the same layers left out)

One optimizer step is one micro batch (no accumulation). Steps are timed one by one (synchronised on
CUDA); reported: median tokens/s over the steps after `--warmup`, MFU against the device's dense peak
(`workers.mfu`; "-" where unknown, e.g. CPUs), peak allocated memory (CUDA only) and elastron/plain.
With a float8 recipe among `--float8`, each float8 row's Elastron tokens/s is also set against Elastron's
row without float8 at the same setting (target: >= 1.25x, and >= 0.97x the plain loop with the same
conversion). On CPU float8 is emulated (slower, not faster): there the rows test the wiring only.

`--loss-compare RECIPES` (e.g. `tensorwise,rowwise`) trains instead, on `--data` (a token file or a directory
of text), Elastron without float8 and then with each recipe, `--loss-steps` each, and reports the mean loss
of each over the last `--loss-window` steps and each recipe's relative difference from bf16 (target: within
1%).

`--profile` adds a torch.profiler table (3 steps, top ops by self device time) per loop and setting, and
the ops whose time per step differs most between the two loops (what is left between them, op by op).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TARGET = 0.97
FLOAT8_SPEEDUP_TARGET = 1.25
LOSS_TARGET = 0.01


def model_overrides(a: argparse.Namespace) -> dict:
    """`--override FIELD=VALUE` (a value is an int, else a float, else YAML: 8 is an int, 1e-6 a float)
    and `--layers N` as `model.overrides`; a malformed one is a one-line error."""
    import yaml

    def scalar(text: str):
        for kind in (int, float):
            try:
                return kind(text)
            except ValueError:
                pass
        return yaml.safe_load(text)

    out = {}
    for item in a.override:
        field, sep, value = item.partition("=")
        if not sep or not field.strip():
            raise SystemExit(f"--override {item!r}: expected FIELD=VALUE, e.g. n_layers=8")
        out[field.strip()] = scalar(value.strip())
    if a.layers is not None:
        out["n_layers"] = a.layers
    return out


def _job_cfg(a: argparse.Namespace, micro_batch: int, compile_: bool, ac: str, float8: str = "none") -> dict:
    return {
        "model": {"preset": a.preset, "overrides": model_overrides(a)},
        "data": {"source": "synthetic", "seq_len": a.seq_len, "num_samples": 100_000},
        "train": {"steps": 1_000_000, "global_batch_size": micro_batch, "micro_batch_size": micro_batch,
                  "lr": 1e-4, "warmup_steps": 0, "schedule": "constant", "grad_clip": 1.0, "dtype": a.dtype,
                  "compile": compile_, "activation_checkpointing": ac, "seed": 0, "float8": float8},
        "resources": {"device": a.device},
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Elastron:
    name = "elastron"

    def __init__(self, cfg, device: torch.device) -> None:
        from parallel.layout import Layout
        from workers.trainer import Trainer

        self.trainer = Trainer(cfg, layout=Layout.parse("dp=1"), device=device).build()
        self.batches: list = []
        self.trainer.on_batch = self.batches.append
        self.losses: list[float] = []

    def step(self) -> None:
        self.losses.append(self.trainer.train_step().loss)


class Plain:
    name = "plain"

    def __init__(self, cfg, device: torch.device, batches: list) -> None:
        from models.llama import Transformer, init_value

        mc, t = cfg.model.build(), cfg.train
        with torch.device(device):
            model = Transformer(mc)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(init_value(mc, name, tuple(p.shape), t.seed))
        model.init_buffers(device)
        if t.float8 != "none":
            from parallel.float8 import convert_float8

            convert_float8(model, t.float8, emulate=device.type == "cpu", fsdp_float8_all_gather=False)
        for block in model.layers.values():
            if t.activation_checkpointing != "none":
                _checkpointed(block)
            if t.compile:
                block.compile(fullgraph=True)
        self.model, self.device, self.batches = model, device, batches
        self.params = list(model.parameters())
        fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.opt = torch.optim.AdamW(self.params, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                     weight_decay=t.weight_decay, **fused)
        self.clip = t.grad_clip
        self.bf16 = t.dtype == "bfloat16"
        self.losses: list[torch.Tensor] = []

    def step(self) -> None:
        batch = self.batches[len(self.losses)]
        (x,), (y,) = batch.inputs, batch.targets
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.clip, foreach=True)
        self.opt.step()
        self.losses.append(loss.detach())


def _checkpointed(block) -> None:
    from torch.utils.checkpoint import checkpoint

    inner = block.forward
    block.forward = lambda *args: checkpoint(inner, *args, use_reentrant=False)


def _time(loops: list, device: torch.device, warmup: int, steps: int) -> list[list[float]]:
    """Per loop, the times of its steps after `warmup`; with several loops their steps alternate (elastron
    first: it records the batch the plain loop replays)."""
    times: list[list[float]] = [[] for _ in loops]
    for i in range(warmup + steps):
        for loop, ts in zip(loops, times):
            _sync(device)
            t0 = time.perf_counter()
            loop.step()
            _sync(device)
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
    return times


PROFILE_STEPS = 3
TOTAL = "(total)"
# CUDA profiler markers that are no op: "Command Buffer Full" is the host blocked on a full launch queue
# (a loop that runs ahead of its GPU). The H200 profile listed it with 123 ms of "self device time" per
# step, which topped the difference table; it is listed after the totals, by its count per step.
MARKERS = frozenset({"Command Buffer Full"})


def _profile(loop, device: torch.device, rows: int = 15) -> tuple[str, dict[str, list[float]]]:
    """torch.profiler over `PROFILE_STEPS` steps: the table of the top ops by self device time (CPU time on
    a CPU), and per op [self ms per step, calls per step] for the difference between the loops."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(PROFILE_STEPS):
            loop.step()
        _sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    avgs = prof.key_averages()
    ops = {e.key: [getattr(e, key) / 1e3 / PROFILE_STEPS, e.count / PROFILE_STEPS]
           for e in avgs if getattr(e, key) > 0 or e.key in MARKERS}
    # On CUDA an op's self device time is that of the kernels it launched, which are listed as entries of
    # their own too: the total counts the kernels alone (on a CPU, every op).
    kernels = [e for e in avgs if e.device_type != DeviceType.CPU]
    ops[TOTAL] = [sum(getattr(e, key) for e in (kernels or avgs)) / 1e3 / PROFILE_STEPS, 0.0]
    return avgs.table(sort_by=key, row_limit=rows), ops


def profile_difference(el: dict[str, list[float]], pl: dict[str, list[float]], rows: int = 12) -> str:
    """The ops where the two loops' self time per step differs most, elastron minus plain, and the totals:
    what is left between them, op by op."""
    lines = ["| op | elastron ms/step (calls) | plain ms/step (calls) | elastron - plain ms/step |",
             "|---|---|---|---|"]
    zero = [0.0, 0.0]
    keys = sorted((el.keys() | pl.keys()) - {TOTAL} - MARKERS, key=lambda k: (-abs(el.get(k, zero)[0] - pl.get(k, zero)[0]), k))
    for k in keys[:rows]:
        (te, ce), (tp, cp) = el.get(k, zero), pl.get(k, zero)
        lines.append(f"| {k} | {te:.2f} ({ce:.3g}) | {tp:.2f} ({cp:.3g}) | {te - tp:+.2f} |")
    te, tp = el[TOTAL][0], pl[TOTAL][0]
    lines.append(f"| {TOTAL} | {te:.2f} | {tp:.2f} | {te - tp:+.2f} |")
    for k in sorted((el.keys() | pl.keys()) & MARKERS):
        ce, cp = el.get(k, zero)[1], pl.get(k, zero)[1]
        lines.append(f"| {k} (a marker, not a kernel: calls per step) | ({ce:.3g}) | ({cp:.3g}) | |")
    return "\n".join(lines)


def _summary(loop, device, a, times: list[float], tokens_per_step: int, flops_per_token: float, peak) -> dict:
    from workers.mfu import mfu

    tps = tokens_per_step / statistics.median(times)
    out = {"tokens_per_s": tps, "mfu": mfu(tps, flops_per_token, 1, peak),
           "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
           "step_ms_median": 1e3 * statistics.median(times)}
    if a.profile:
        out["profile"], out["profile_ops"] = _profile(loop, device)
    return out


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_setting(a, device, micro_batch: int, compile_: bool, ac: str, float8: str = "none") -> dict:
    from workers.config import JobConfig
    from workers.mfu import peak_flops

    cfg = JobConfig.from_dict(_job_cfg(a, micro_batch, compile_, ac, float8))
    mc = cfg.model.build()
    tokens = micro_batch * a.seq_len
    fpt = mc.flops_per_token(a.seq_len)
    peak = peak_flops(torch.cuda.get_device_name(device) if device.type == "cuda" else None, a.dtype)
    res = {"micro_batch": micro_batch, "compile": compile_, "ac": ac, "float8": float8, "interleaved": a.interleave}
    # Each loop compiles from a clean cache: compiled graphs of earlier models and micro batches would
    # count towards dynamo's recompile limit, past which blocks silently run eager.
    torch.compiler.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    el = Elastron(cfg, device)
    if a.interleave:
        # Peak memory is of both loops together here; run without --interleave for each alone.
        pl = Plain(cfg, device, el.batches)
        el_times, pl_times = _time([el, pl], device, a.warmup, a.steps)
        res["paired_ratio"] = statistics.median(p / e for e, p in zip(el_times, pl_times))
    else:
        (el_times,) = _time([el], device, a.warmup, a.steps)
    res["elastron"] = _summary(el, device, a, el_times, tokens, fpt, peak)
    el_losses = el.losses
    if not a.interleave:
        batches = el.batches
        del el
        _free(device)
        torch.compiler.reset()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        pl = Plain(cfg, device, batches)
        (pl_times,) = _time([pl], device, a.warmup, a.steps)
    res["plain"] = _summary(pl, device, a, pl_times, tokens, fpt, peak)
    n = min(len(el_losses), len(pl.losses))
    pl_losses = [float(x) for x in pl.losses[:n]]
    res["max_loss_rel_diff"] = max(abs(e - p) / abs(p) for e, p in zip(el_losses[:n], pl_losses))
    res["ratio"] = res["elastron"]["tokens_per_s"] / res["plain"]["tokens_per_s"]
    del pl
    _free(device)
    return res


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def table(results: list[dict]) -> str:
    lines = ["| micro batch | compile | AC | float8 | loop | tokens/s | MFU | peak mem (GiB) | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name in ("elastron", "plain"):
            m = r[name]
            ratio = f"{r['ratio']:.2f}" if name == "elastron" else "1.00"
            lines.append(f"| {r['micro_batch']} | {'yes' if r['compile'] else 'no'} | {r['ac']} | {r['float8']} | "
                         f"{name} | {m['tokens_per_s']:,.0f} | {_fmt(m['mfu'], '.1%')} | "
                         f"{_fmt(m['peak_mem_gib'], '.1f')} | {ratio} |")
    return "\n".join(lines)


def float8_speedups(results: list[dict]) -> list[str]:
    """Per float8 row: Elastron float8 tokens/s over Elastron without float8 at the same setting, and over
    the plain loop with the same conversion."""
    base = {(r["micro_batch"], r["compile"], r["ac"]): r for r in results if r["float8"] == "none"}
    lines = []
    for r in results:
        if r["float8"] == "none":
            continue
        setting = f"mb {r['micro_batch']} compile {'yes' if r['compile'] else 'no'} AC {r['ac']} {r['float8']}"
        b = base.get((r["micro_batch"], r["compile"], r["ac"]))
        vs_bf16 = (f"{r['elastron']['tokens_per_s'] / b['elastron']['tokens_per_s']:.2f}x elastron without float8"
                   if b else "no row without float8 to compare")
        lines.append(f"{setting}: {vs_bf16} (target >= {FLOAT8_SPEEDUP_TARGET}), {r['ratio']:.2f}x the plain "
                     f"float8 loop (target >= {TARGET})")
    return lines


def loss_compare(a, device) -> dict:
    """Elastron without float8, then with each recipe of `a.loss_compare` (a list), `a.loss_steps` steps
    each on `a.data`: the mean loss over the last `a.loss_window` steps of each run, and each recipe's
    relative difference from the run without."""
    from workers.config import JobConfig
    from workers.trainer import Trainer
    from parallel.layout import Layout

    path = Path(a.data)
    data = ({"source": "tokens", "path": str(path), "token_dtype": a.token_dtype} if path.is_file()
            else {"source": "corpus", "path": str(path), "suffixes": a.suffixes.split(",")})
    mb = int((a.micro_batches or "2").split(",")[0])
    means = {}
    for recipe in ("none", *a.loss_compare):
        d = _job_cfg(a, mb, _flags(a.compile or "no")[0], a.ac.split(",")[0], recipe)
        d["data"] = {**data, "seq_len": a.seq_len}
        d["train"].update(steps=a.loss_steps, lr=a.loss_lr, warmup_steps=min(a.loss_steps // 10, 100),
                          schedule="cosine", global_batch_size=mb * a.loss_accum)
        torch.compiler.reset()
        trainer = Trainer(JobConfig.from_dict(d), layout=Layout.parse("dp=1"), device=device).build()
        losses = [trainer.train_step().loss for _ in range(a.loss_steps)]
        print(f"{recipe}: first loss {losses[0]:.4f}, last {losses[-1]:.4f}", file=sys.stderr, flush=True)
        means[recipe] = statistics.fmean(losses[-a.loss_window:])
        del trainer
        _free(device)
    rows = [{"recipe": r, "mean_loss": means[r], "rel_diff": abs(means[r] - means["none"]) / abs(means["none"])}
            for r in a.loss_compare]
    return {"steps": a.loss_steps, "window": a.loss_window, "mean_loss_none": means["none"], "rows": rows}


def _flags(text: str) -> list[bool]:
    return [v.strip().lower() in ("yes", "true", "1") for v in text.split(",")]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", default=None, help="model preset (default: 1b on cuda, tiny on cpu)")
    p.add_argument("--seq-len", type=int, default=None, help="default: 2048 on cuda, 128 on cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--micro-batches", default=None, help="comma-separated (default: 4,8 on cuda, 2 on cpu)")
    p.add_argument("--compile", default=None, help="comma-separated yes/no (default: no,yes on cuda, no on cpu)")
    p.add_argument("--ac", default="none", help="comma-separated none/full/selective")
    p.add_argument("--float8", default="none", help="comma-separated none/tensorwise/rowwise (train.float8)")
    p.add_argument("--layers", type=int, default=None, help="n_layers of the preset (e.g. 8 of the 8b)")
    p.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                   help="change a preset field, e.g. vocab_size=128256 (repeatable)")
    p.add_argument("--loss-compare", default=None, metavar="RECIPES",
                   help="train without float8, then with each float8 recipe (tensorwise,rowwise) on --data, "
                        "and compare their losses")
    p.add_argument("--data", default=None, help="--loss-compare: a token file or a directory of text")
    p.add_argument("--token-dtype", choices=("uint16", "uint32"), default="uint32",
                   help="--loss-compare with a token file: its element type")
    p.add_argument("--suffixes", default=".py,.txt,.md", help="--loss-compare with a directory: file endings")
    p.add_argument("--loss-steps", type=int, default=300, help="--loss-compare: steps per run")
    p.add_argument("--loss-window", type=int, default=50, help="--loss-compare: last steps averaged")
    p.add_argument("--loss-lr", type=float, default=3e-4, help="--loss-compare: peak learning rate")
    p.add_argument("--loss-accum", type=int, default=1, help="--loss-compare: micro batches per step")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps (default: 4 on cuda, 2 on cpu)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 9 on cuda, 5 on cpu)")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler breakdown per loop")
    p.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                   help="alternate the two loops' steps (default: on CPU yes, on CUDA no)")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    a.preset = a.preset or ("1b" if cuda else "tiny")
    a.seq_len = a.seq_len or (2048 if cuda else 128)
    a.dtype = a.dtype or ("bfloat16" if cuda else "float32")
    a.warmup = a.warmup if a.warmup is not None else (4 if cuda else 2)
    a.steps = a.steps or (9 if cuda else 5)
    a.interleave = a.interleave if a.interleave is not None else not cuda
    micro_batches = [int(x) for x in (a.micro_batches or ("4,8" if cuda else "2")).split(",")]
    compiles = _flags(a.compile or ("no,yes" if cuda else "no"))
    acs = [x.strip() for x in a.ac.split(",")]
    recipes = [x.strip() for x in a.float8.split(",")]
    if bad := [r for r in recipes if r not in ("none", "tensorwise", "rowwise")]:
        p.error(f"--float8 {','.join(bad)}: expected none, tensorwise or rowwise")
    if a.loss_compare is not None:
        a.loss_compare = [x.strip() for x in a.loss_compare.split(",") if x.strip()]
        if not a.loss_compare or (bad := [r for r in a.loss_compare if r not in ("tensorwise", "rowwise")]):
            p.error(f"--loss-compare {','.join(bad if a.loss_compare else [])}: expected tensorwise and/or rowwise")
    if a.loss_compare and not a.data:
        p.error("--loss-compare needs --data (a token file or a directory of text)")
    if a.loss_compare and not 0 < a.loss_window <= a.loss_steps:
        p.error(f"--loss-window {a.loss_window} must be in 1..--loss-steps ({a.loss_steps})")
    from workers.config import ConfigError, JobConfig

    try:  # a bad --override or --layers fails here, in one line, before any device work
        JobConfig.from_dict(_job_cfg(a, micro_batches[0], compiles[0], acs[0]))
    except ConfigError as e:
        p.error(str(e))

    from workers.runtime import destroy_process_group, init_process_group, pick_device

    device = pick_device(a.device)
    init_process_group(device)
    results = []
    try:
        if a.loss_compare:
            lc = loss_compare(a, device)
            for row in lc["rows"]:
                print(f"{a.preset} {model_overrides(a)}, seq {a.seq_len}, {a.dtype}, {device.type}, data {a.data}: "
                      f"mean loss over the last {lc['window']} of {lc['steps']} steps: none {lc['mean_loss_none']:.4f}, "
                      f"{row['recipe']} {row['mean_loss']:.4f}, relative difference {row['rel_diff']:.2%} "
                      f"(target <= {LOSS_TARGET:.0%})")
            if a.json:
                Path(a.json).write_text(json.dumps({"args": vars(a), "loss_compare": lc}, indent=2))
            return {"loss_compare": lc}
        for mb in micro_batches:
            for c in compiles:
                for ac in acs:
                    for f8 in recipes:
                        print(f"micro batch {mb}, compile {c}, AC {ac}, float8 {f8} ...", file=sys.stderr, flush=True)
                        results.append(run_setting(a, device, mb, c, ac, f8))
    finally:
        destroy_process_group()
    print(f"{a.preset}{' ' + str(model_overrides(a)) if model_overrides(a) else ''}, seq {a.seq_len}, {a.dtype}, dp=1, {device.type}"
          f"{' (' + torch.cuda.get_device_name(device) + ')' if cuda else ''}, torch {torch.__version__}; "
          f"median of {a.steps} steps after {a.warmup}, "
          f"{'interleaved' if a.interleave else 'one loop after the other'}; "
          f"target elastron/plain >= {TARGET}")
    print(table(results))
    if a.interleave:
        print("paired (median over steps of plain time / elastron time, steps alternating): "
              + ", ".join(f"mb {r['micro_batch']} compile {'yes' if r['compile'] else 'no'} AC {r['ac']}"
                          f"{' float8 ' + r['float8'] if r['float8'] != 'none' else ''}: {r['paired_ratio']:.2f}"
                          for r in results))
    if any(r["float8"] != "none" for r in results):
        print("float8: " + "; ".join(float8_speedups(results)))
    worst = max(r["max_loss_rel_diff"] for r in results)
    print(f"losses: elastron and plain within {worst:.1e} (relative) step by step")
    for r in results:
        setting = f"micro batch {r['micro_batch']}, compile {r['compile']}, AC {r['ac']}" + (
            f", float8 {r['float8']}" if r["float8"] != "none" else "")
        for name in ("elastron", "plain"):
            if "profile" in r[name]:
                print(f"\n## profile: {name}, {setting}")
                print(r[name].pop("profile"))
        if "profile_ops" in r["elastron"]:
            print(f"\n## profile difference, {setting} (self {'device' if cuda else 'CPU'} time per step, "
                  f"{PROFILE_STEPS} steps)")
            print(profile_difference(r["elastron"]["profile_ops"], r["plain"]["profile_ops"]))
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=2))
    return {"results": results}


if __name__ == "__main__":
    main()
