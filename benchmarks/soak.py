"""Soak: one job lives through many reconfigurations of every kind; the memory of every process after each.

    .venv/bin/python benchmarks/soak.py --reconfigs 30 [--preset small] [--reshard live] \
        [--kinds shrink,grow,kill_worker,drain,takeover] [--json benchmarks/results/soak.json]

A `ray.cluster_utils.Cluster` (head without worker slots, `--nodes` one-CPU worker nodes) runs the job API
as its own process (benchmarks/chaos_server.py, the real app); one job (`--preset`, FSDP over up to
`--nodes` workers, checkpoint every 8 steps) is submitted over REST. Then, in a rotation, one event at a
time, each once the job trains at full size again:

  shrink      a resize to one worker fewer (REST), through `parallel.reshard` (live or storage)
  grow        a resize back to every node (REST)
  kill_worker SIGKILL of the newest training worker: the survivors heal from peers or restore from
              storage, then the job grows back onto the freed slot
  drain       a drain notice with a 60 s deadline on a node without the oldest worker: the job moves
              off it; the node is removed and a new one added, and the job grows back

The oldest worker is never the victim, so one process lives through every reconfiguration.
  takeover    SIGKILL of the job's coordinator actor: Ray restarts it and it takes over its workers (the
              job's budget, benchmarks/chaos_server.py's max_restarts=20 within 10 minutes, allows the
              rotation's pace; `elastron serve`'s default is 3 within 10 minutes)

Each event counts the reconfigurations it caused (the job's `resize` events: a drain is two, off the
node and back onto a new one; a kill one or two, as a standby can take the dead worker's place at once). After each event, once the job has trained `--steps-after` steps at full
size, the resident memory (RSS, from /proc) of every process is sampled: each training worker and
standby (the `ray::Worker` processes under the nodes' raylets), the coordinator (the job's actor) and
the API server; where the workers train on CUDA, also each worker's `memory_allocated`/`memory_reserved`,
which its own process reports (`Worker.memory`, on its control lane). Written: the JSON (every sample),
and with matplotlib a PNG of memory against reconfiguration number; the check is every process's RSS at
its last sample against its value after its 3rd reconfiguration at the same world size (target: at most
1.10x) and, on CUDA, each worker's `memory_reserved` the same way (at most 1.05x).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.chaos_env import ChaosEnv, ask_workers, wait  # noqa: E402

KINDS = ("shrink", "grow", "kill_worker", "drain", "takeover")
TARGET = 1.10
"""Every process's RSS at the end over its value after the 3rd reconfiguration, at most."""
CUDA_TARGET = 1.05
"""Every CUDA worker's `memory_reserved` at the end over its value after the 3rd reconfiguration, at most."""


def worker_memory(*, timeout_s: float = 10.0) -> dict[int, object]:
    """pid -> `workers.report.Memory` of every worker actor of the cluster's jobs that answers within
    `timeout_s` (on the control lane, so a worker inside a step answers too)."""
    return {m.pid: m for m in ask_workers("memory", timeout_s=timeout_s)}


def cuda_columns(procs: dict[str, int], memory: dict[int, object]) -> dict[str, dict[str, float]]:
    """`memory_allocated` and `memory_reserved` (MB) per process name, for the workers on CUDA among `procs`
    (empty on CPU)."""
    out: dict[str, dict[str, float]] = {"cuda_allocated_mb": {}, "cuda_reserved_mb": {}}
    for name, pid in procs.items():
        m = memory.get(pid)
        if m is not None and m.cuda_reserved_mb is not None:
            out["cuda_allocated_mb"][name] = m.cuda_allocated_mb
            out["cuda_reserved_mb"][name] = m.cuda_reserved_mb
    return out


def job_config(preset: str, nodes: int, reshard: str, steps: int) -> dict:
    """`parallel.drain_margin` 0: a drain moves off at once (the soak counts memory per reconfiguration;
    a hold until the deadline less the lead would only stretch each drain to its 60 s notice)."""
    return {
        "name": "soak",
        "model": {"preset": preset},
        "data": {"source": "synthetic", "seq_len": 64},
        "train": {"steps": steps, "global_batch_size": 4, "micro_batch_size": 1, "lr": 1e-3, "warmup_steps": 2,
                  "seed": 5},
        "parallel": {"min_workers": 1, "max_workers": nodes, "dp_mode": "shard", "reshard": reshard,
                     "drain_margin": 0.0},
        "checkpoint": {"interval_steps": 8, "keep_last": 2},
        "resources": {"device": "cpu", "cpus_per_worker": 1},
    }


def _started(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return 0.0


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


HEAP_MAX = 64 * 2**20
"""glibc's HEAP_MAX_SIZE on 64-bit: every heap of a non-main arena is a mapping aligned to it."""


def glibc_heaps(pid: int) -> dict | None:
    """Where a process's resident memory sits, from /proc/PID/smaps: the main arena's `[heap]` (brk), the
    heaps of glibc's other arenas (anonymous read-write mappings starting at a 64 MiB boundary, each
    followed by its reserved rest), and every other anonymous mapping (mmapped blocks above glibc's mmap
    threshold, thread stacks, Ray's and torch's own mappings). A count of arena heaps that grows with
    reconfigurations means new arenas (one per thread that allocates, up to 8 per core by default)."""
    try:
        with open(f"/proc/{pid}/smaps") as f:
            text = f.read()
    except OSError:
        return None
    out = {"brk_heap_mb": 0.0, "arena_heaps": 0, "arena_heaps_mb": 0.0, "other_anon_mb": 0.0}
    head = None
    for line in text.splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) \S+ \S+ (\d+)\s*(.*)$", line)
        if m:
            start, perms, inode, name = int(m.group(1), 16), m.group(3), m.group(4), m.group(5).strip()
            if name == "[heap]":
                head = "brk_heap_mb"
            elif inode == "0" and not name and perms.startswith("rw"):
                if start % HEAP_MAX == 0:
                    head = "arena_heaps_mb"
                    out["arena_heaps"] += 1
                else:
                    head = "other_anon_mb"
            else:
                head = None
        elif head and line.startswith("Rss:"):
            out[head] += int(line.split()[1]) / 1024
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}


class Soak:
    def __init__(self, workdir: Path, *, preset: str, nodes: int, reshard: str, steps_after: int, log=print):
        # Ray may restart the coordinator without a cap here; the job's own budget still applies.
        self.env = ChaosEnv(workdir, nodes=nodes, log=log, server_args=("--coordinator-restarts", "-1"))
        self.preset, self.nodes, self.reshard, self.steps_after, self.log = preset, nodes, reshard, steps_after, log
        self.job_id = ""
        self.samples: list[dict] = []
        self.partial: Path | None = None
        """Where every sample so far is written as it is taken (a soak stopped early keeps them)."""

    def api(self, method: str, *args, **kw):
        from api.client import APIError, Client

        def call():
            try:
                with Client(self.env.url, timeout=30) as c:
                    return [getattr(c, method)(*args, **kw)]
            except APIError as e:  # 503 while a coordinator restarts
                if e.status not in (None, 503):
                    raise
                return None
        return wait(call, 120, f"the API to answer {method}", interval=0.5)[0]

    def job(self) -> dict:
        return self.api("job", self.job_id)

    def reconfigs(self) -> int:
        """Reconfigurations so far: the job's `resize` events (a restarted coordinator's status counts
        only its own; the event log has them all)."""
        return sum(1 for e in self.api("events", self.job_id) if e["kind"] == "resize")

    def _at(self, size: int, after_step: int) -> dict | None:
        j = self.job()
        if j["state"] in ("FAILED", "STOPPED", "SUCCEEDED"):
            raise RuntimeError(f"the job ended {j['state']}: {j.get('reason')} {j.get('error')}")
        return j if j["state"] == "RUNNING" and j["world_size"] == size and (j["step"] or 0) >= after_step else None

    def settle(self, size: int, before: int, *, at_least: int = 1) -> dict:
        """Until `at_least` reconfigurations more than `before` are counted and the job has trained
        `steps_after` steps at `size` workers since."""
        wait(lambda: self.reconfigs() >= before + at_least, 300, f"{at_least} reconfiguration(s)", interval=0.3)
        j = wait(lambda: self._at(size, 0), 300, f"the job to run on {size} workers", interval=0.3)
        start = j["step"]
        return wait(lambda: self._at(size, start + self.steps_after), 300, "steps after the reconfiguration",
                    interval=0.3)

    def processes(self) -> dict[str, int]:
        """role-pid -> pid of every process of the job: workers (members and standbys), coordinator, server."""
        members = self.env.member_pids()
        out = {}
        for n in self.env.nodes:
            for pid in self.env.workers_on(n):
                out[f"{'worker' if pid in members else 'standby'}-{pid}"] = pid
        out[f"coordinator-{self.job()['pid']}"] = self.job()["pid"]
        if self.env.api_proc is not None:
            out[f"server-{self.env.api_proc.pid}"] = self.env.api_proc.pid
        return out

    def sample(self, kind: str, t0: float) -> dict:
        j = self.job()
        procs = self.processes()
        rss = {name: round(v, 1) for name, pid in procs.items() if (v := rss_mb(pid)) is not None}
        heaps = {name: h for name, pid in procs.items() if not name.startswith(("server", "coordinator"))
                 and (h := glibc_heaps(pid)) is not None}
        s = {"reconfigs": self.reconfigs(), "kind": kind, "seconds": round(time.time() - t0, 1), "step": j["step"],
             "world_size": j["world_size"], "events": j.get("events"), "rss_mb": rss, "glibc_heaps": heaps,
             **cuda_columns(procs, memory := worker_memory()),
             "reporting": sorted(name for name, pid in procs.items() if pid in memory)}
        self.samples.append(s)
        if self.partial is not None:
            self.partial.write_text(json.dumps({"partial": True, "samples": self.samples}, indent=1))
        self.log(f"#{s['reconfigs']:>3} {kind:<11} step {s['step']:>5} w={s['world_size']} "
                 + " ".join(f"{k}={v:.0f}" for k, v in sorted(rss.items()))
                 + f" | memory() answered by {len(s['reporting'])}"
                 + "".join(f" {k} reserved={v:.0f}" for k, v in sorted(s["cuda_reserved_mb"].items())))
        return s

    # -- the events ----------------------------------------------------------------------------------------
    def shrink(self) -> None:
        from service.control.commands import SetWorkers

        before = self.reconfigs()
        self.api("command", self.job_id, SetWorkers(workers=self.nodes - 1))
        self.settle(self.nodes - 1, before)

    def grow(self) -> None:
        from service.control.commands import SetWorkers

        before = self.reconfigs()
        self.api("command", self.job_id, SetWorkers(workers=self.nodes))
        self.settle(self.nodes, before)

    def kill_worker(self) -> None:
        before = self.reconfigs()
        pid = max(wait(self.env.worker_pids, 60, "a training worker"), key=_started)  # the oldest survives
        os.kill(pid, signal.SIGKILL)
        self.settle(self.nodes, before)  # healed or restored, and grown back if it had to shrink

    def drain(self) -> None:
        from service.pool.cluster import drain_node

        before = self.reconfigs()
        oldest = min(wait(self.env.worker_pids, 60, "a training worker"), key=_started)
        node = next(n for n in wait(self.env.nodes_with_workers, 60, "a node with workers")
                    if oldest not in self.env.workers_on(n))  # the oldest survives
        drain_node(node.node_id, message="soak: spot reclaim", deadline_remaining_s=60.0)
        wait(lambda: not self.env.workers_on(node, members=self.env.member_pids()), 60, "the job to leave the node")
        self.env.remove_node(node)
        self.env.restore_nodes()
        self.settle(self.nodes, before)  # off the node, then onto the new one

    def takeover(self) -> None:
        before_pid = self.job()["pid"]
        before = self.reconfigs()
        os.kill(before_pid, signal.SIGKILL)
        wait(lambda: (j := self.job())["pid"] not in (None, before_pid) and j["state"] == "RUNNING", 300,
             "a restarted coordinator")
        self.settle(self.nodes, before)

    def run(self, n: int, kinds: tuple[str, ...], steps: int) -> dict:
        self.env.start()
        t0 = time.time()
        try:
            created = self.api("submit", job_config(self.preset, self.nodes, self.reshard, steps), steps=steps)
            self.job_id = created["id"]
            wait(lambda: self._at(self.nodes, 2), 600, "the job to train on every node", interval=0.5)
            self.sample("start", t0)
            i = 0
            while self.reconfigs() < n:
                kind = kinds[i % len(kinds)]
                i += 1
                getattr(self, kind)()
                self.sample(kind, t0)
            return {"job": self.job(), "events": self.api("events", self.job_id)}
        finally:
            self.env.close()


def verdict(samples: list[dict], *, base_at: int = 3) -> dict:
    """Per process alive both at the base and at the end: its RSS then and now. The base is the first
    sample after reconfiguration `base_at` at the world size of the last sample (a survivor holds a
    larger share of the state at fewer workers: a shrunk job is compared with itself shrunk)."""
    last = samples[-1] if samples else None
    if last is None:
        return {}
    base = next((s for s in samples if s["reconfigs"] >= base_at and s["world_size"] == last["world_size"]), None)
    if base is None or base is last:
        return {}
    return {name: {"base_reconfigs": base["reconfigs"], "base_mb": base["rss_mb"][name], "end_mb": v,
                   "ratio": round(v / base["rss_mb"][name], 3)}
            for name, v in last["rss_mb"].items() if name in base["rss_mb"]}


def lifetimes(samples: list[dict], *, base_at: int = 3, key: str = "rss_mb") -> dict:
    """Every process sampled, alive at the end or not: its `key` (RSS; or a CUDA column) at its first sample
    after reconfiguration `base_at` of its own life (the first `base_at` of a new process load what it keeps,
    so its 3rd is its steady state) at the world size of its last sample, at its last sample, their ratio,
    and the reconfigurations between the two. A process sampled only once or twice has no entry."""
    seen: dict[str, list[dict]] = {}
    for s in samples:
        for name in s.get(key, {}):
            seen.setdefault(name, []).append(s)
    out = {}
    for name, ss in seen.items():
        last = ss[-1]
        born = ss[0]["reconfigs"] if ss[0] is not samples[0] else 0
        base = next((s for s in ss if s["reconfigs"] >= born + base_at and s["world_size"] == last["world_size"]
                     and s is not last), None)
        if base is None:
            continue
        out[name] = {"base_reconfigs": base["reconfigs"], "base_mb": base[key][name],
                     "end_reconfigs": last["reconfigs"], "end_mb": last[key][name],
                     "ratio": round(last[key][name] / base[key][name], 3) if base[key][name] else None}
    return out


def plot(samples: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    series: dict[str, list[tuple[int, float]]] = {}
    for s in samples:
        for name, v in s["rss_mb"].items():
            series.setdefault(name, []).append((s["reconfigs"], v))
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, pts in sorted(series.items()):
        if len(pts) < 2:
            continue
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=name)
    ax.set_xlabel("reconfiguration number")
    ax.set_ylabel("RSS (MB)")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return True


def passed(out: dict) -> bool:
    """The target: no error, every process sampled at its 3rd and later within TARGET (`lifetimes`: a
    survivor replaced before the end counts too, not only those alive at both ends), and where workers
    ran on CUDA, each one's `memory_reserved` within CUDA_TARGET."""
    worst, cuda = out.get("max_ratio_per_process"), out.get("max_cuda_reserved_ratio")
    return (out.get("error") is None and worst is not None and worst <= TARGET
            and (cuda is None or cuda <= CUDA_TARGET))


def cuda_verdict(samples: list[dict]) -> tuple[dict, float | None]:
    """Per CUDA worker, its `memory_reserved` after its 3rd reconfiguration and at its last sample
    (`lifetimes`), and the worst ratio; ({}, None) where no worker ran on CUDA."""
    lives = lifetimes(samples, key="cuda_reserved_mb")
    return lives, max((r["ratio"] for r in lives.values() if r["ratio"] is not None), default=None)


def report(path: Path) -> int:
    """Add `lifetimes` to the soak JSON at `path` and print it: every process, after its 3rd, at its last
    sample, the ratio."""
    out = json.loads(path.read_text())
    lives = out["per_process"] = lifetimes(out["samples"])
    out["max_ratio_per_process"] = max((r["ratio"] for r in lives.values()), default=None)
    out["cuda_reserved_per_worker"], out["max_cuda_reserved_ratio"] = cuda_verdict(out["samples"])
    out["passed"] = passed(out)
    path.write_text(json.dumps(out, indent=2))
    print("| process | after its 3rd (reconfiguration #, MB) | at its last (#, MB) | ratio |\n|---|---|---|---|")
    for name, r in sorted(lives.items(), key=lambda kv: (kv[0].split("-")[0], kv[1]["base_reconfigs"])):
        print(f"| {name} | #{r['base_reconfigs']}: {r['base_mb']:.1f} | #{r['end_reconfigs']}: {r['end_mb']:.1f} | "
              f"x{r['ratio']:.3f} |")
    for name, r in sorted(out["cuda_reserved_per_worker"].items()):
        print(f"| {name} (CUDA reserved) | #{r['base_reconfigs']}: {r['base_mb']:.1f} | #{r['end_reconfigs']}: "
              f"{r['end_mb']:.1f} | x{r['ratio']} |")
    print(f"max ratio {out['max_ratio_per_process']} (target <= {TARGET}); CUDA reserved "
          f"{out['max_cuda_reserved_ratio']} (target <= {CUDA_TARGET}); {'PASSED' if out['passed'] else 'FAILED'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reconfigs", type=int, default=30, help="stop after this many reconfigurations")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--reshard", choices=("live", "storage"), default="live")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"the rotation (default {','.join(KINDS)})")
    ap.add_argument("--steps-after", type=int, default=2, help="steps at full size before each sample")
    ap.add_argument("--workdir")
    ap.add_argument("--json", help="default: benchmarks/results/soak-<preset>-<reshard>.json (and .png)")
    ap.add_argument("--report", metavar="JSON", help="run nothing: print (and add to) a soak JSON's per-process table")
    a = ap.parse_args(argv)
    if a.report:
        return report(Path(a.report))
    kinds = tuple(k for k in a.kinds.split(",") if k)
    if not kinds or (bad := [k for k in kinds if k not in KINDS]):
        ap.error(f"unknown kind(s) {bad if kinds else a.kinds!r}: choose from {', '.join(KINDS)}")
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="soak-"))
    out_json = Path(a.json or ROOT / "benchmarks" / "results" / f"soak-{a.preset}-{a.reshard}.json")
    out_json.parent.mkdir(parents=True, exist_ok=True)
    soak = Soak(workdir, preset=a.preset, nodes=a.nodes, reshard=a.reshard, steps_after=a.steps_after)
    soak.partial = out_json
    t0 = time.time()
    try:
        result = soak.run(a.reconfigs, kinds, steps=1_000_000)
        error = None
    except (Exception, KeyboardInterrupt) as e:  # keep what was sampled: a soak that stops early still says where memory went
        result, error = {}, f"{type(e).__name__}: {e}"
        print(f"soak stopped early: {error}", file=sys.stderr)
    ratios = verdict(soak.samples)
    lives = lifetimes(soak.samples)
    out = {"command": " ".join([sys.executable.rsplit("/", 1)[-1], *sys.argv]), "preset": a.preset,
           "nodes": a.nodes, "reshard": a.reshard, "kinds": kinds, "wall_s": round(time.time() - t0, 1),
           "error": error, "samples": soak.samples, "ratios_vs_3rd": ratios,
           "per_process": lives, "max_ratio_per_process": max((r["ratio"] for r in lives.values()), default=None),
           "max_ratio": max((r["ratio"] for r in ratios.values()), default=None),
           **dict(zip(("cuda_reserved_per_worker", "max_cuda_reserved_ratio"), cuda_verdict(soak.samples))),
           "reconfigurations": (result.get("job") or {}).get("reconfigurations")}
    out["passed"] = passed(out)
    out_json.write_text(json.dumps(out, indent=2))
    plot(soak.samples, out_json.with_suffix(".png"),
         f"soak: {a.preset}, {a.reshard}, {','.join(kinds)} ({len(soak.samples) - 1} events)")
    for name, r in sorted(ratios.items()):
        print(f"{name:<22} after #{r['base_reconfigs']} {r['base_mb']:>8.1f} MB  end {r['end_mb']:>8.1f} MB  "
              f"x{r['ratio']:.3f}")
    print(f"alive at both ends: max ratio {out['max_ratio']}; every process after its 3rd: "
          f"{out['max_ratio_per_process']} (target <= {TARGET}); CUDA reserved per worker: "
          f"{out['max_cuda_reserved_ratio']} (target <= {CUDA_TARGET}; None: no worker on CUDA); "
          f"{'PASSED' if out['passed'] else 'FAILED'}")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
