"""Abuse: hostile requests of every kind of the fourth security review (issue 52) from two users, while a
third user's job trains; the third user's reads, the server's memory and the store are watched.

    .venv/bin/python benchmarks/abuse.py [--concurrency 200] [--rounds 3] [--per-user 8,off] \
        [--json benchmarks/results/abuse.json]

`elastron serve` runs as its own process on 127.0.0.1 (loopback only; a private local Ray), with an admin
token and users alice, bob and carol (`ELASTRON_QUOTAS=alice=1:1,bob=1:1`: one worker and one running job
each, priority ceiling 0; `ELASTRON_MAX_LIVE_JOBS=2`). Carol's job (the tiny preset, synthetic data, one
worker) trains throughout. Then, for `--rounds` rounds, `--concurrency` requests at once, alice's and
bob's in turn, cycling through the kinds in KINDS (deep JSON in four places, a 900 KB path, standby and
eval sizes of 401 digits, a priority of 10^6, a 100 000-character name, an object store's root, a
non-ASCII HDFS port, an unclaimed directory, a file:// data path, another user's job, /metrics). All the
while carol reads her job and its metrics every 50 ms, and the server's resident memory (its process
only, not Ray's) is sampled every 0.2 s.

Checked, and printed as a table: the p99 and worst of carol's reads before and during the attack (and the
worst p99 of any 1 s window of the attack), the server's peak RSS against its RSS before the attack (after
one request of each kind, so that lazy imports are not counted as growth), the status codes (no 5xx), carol's
job still training, and the store intact (admin list answers; SQLite `PRAGMA integrity_check` is "ok").
Bounded: at most rounds x concurrency hostile requests, each with a 30 s timeout, and `--deadline` seconds.
One run per `--per-user` value (ELASTRON_MAX_REQUESTS_PER_USER; `off`: no per-token limit, every other
fix in place), one after the other, each on a server of its own; the exit status is the first run's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
ADMIN, ALICE, BOB, CAROL = "abuse-admin", "abuse-alice", "abuse-bob", "abuse-carol"
J = "/api/v1/jobs"

BASE = {"name": "h", "model": {"preset": "tiny"}, "data": {"source": "synthetic", "seq_len": 32},
        "train": {"steps": 20, "global_batch_size": 4, "micro_batch_size": 2},
        "parallel": {"min_workers": 1, "max_workers": 1}, "checkpoint": {"interval_steps": 1000},
        "resources": {"standby_per_node": 0}}
CAROL_SPEC = {**BASE, "name": "carol", "train": {**BASE["train"], "steps": 1_000_000}}


def spec(**sections) -> dict:
    out = json.loads(json.dumps(BASE))
    for k, v in sections.items():
        out[k] = {**out.get(k, {}), **v} if isinstance(v, dict) else v
    return out


def kinds(root: Path, other_job: str) -> dict[str, tuple[str, str, str]]:
    """name -> (method, path, raw JSON body)."""
    deep = "[" * 480 + "]" * 480
    corpus = {"source": "corpus", "path": str(root / "data" / "corpus")}
    dump = lambda s, **kw: json.dumps({"spec": s, **kw})  # noqa: E731
    return {
        "deep name": ("POST", J, '{"spec": {"name": %s}}' % deep),
        "deep run_dir": ("POST", J, '{"spec": %s, "run_dir": %s}' % (json.dumps(BASE), deep)),
        "deep unknown key": ("POST", J, '{"spec": %s, "x": %s}' % (json.dumps(BASE), deep)),
        "deep resize": ("POST", f"{J}/{other_job}/resize", '{"workers": %s}' % deep),
        "900 KB path": ("POST", J, dump(spec(data={**corpus, "path": "/etc/" + "a/" * 450_000}))),
        "standby 401 digits": ("POST", J, dump(spec(resources={"standby_per_node": 10**400}))),
        "eval_batches 401 digits": ("POST", J, dump(spec(train={"eval_batches": 10**400}))),
        "priority 1e6": ("POST", J, dump(spec(scheduling={"priority": 1_000_000}))),
        "100k name": ("POST", J, dump(spec(name="n" * 100_000))),
        "store root": ("POST", J, dump(spec(checkpoint={"dir": "s3://ckpts"}))),
        "hdfs port \u00b2": ("POST", J, dump(spec(checkpoint={"dir": "hdfs://nn:\u00b2/jobs/x"}))),
        "unclaimed dir": ("POST", J, dump(BASE, run_dir="ops-manual-run")),
        "file:// data": ("POST", J, dump(spec(data={**corpus, "path": "file://" + str(root / "data" / "corpus")}))),
        "another user's job": ("GET", f"{J}/{other_job}", ""),
        "metrics": ("GET", "/metrics", ""),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(cond, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if (v := cond()):
            return v
        time.sleep(0.2)
    raise TimeoutError(f"{what} not within {timeout:.0f} s")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds for the attack at most")
    ap.add_argument("--per-user", default="8,off",
                    help="ELASTRON_MAX_REQUESTS_PER_USER of each run, comma-separated (off: no limit); one run each")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if not 1 <= a.concurrency <= 400 or not 1 <= a.rounds <= 20:
        ap.error("--concurrency must be 1..400 and --rounds 1..20 (the benchmark is bounded)")
    results = []
    for per_user in a.per_user.split(","):
        print(f"== ELASTRON_MAX_REQUESTS_PER_USER={per_user}")
        r = run_once(a, "" if per_user == "off" else per_user)
        r["per_user"] = per_user
        _print(r)
        r["targets_met"] = met(r)
        print("targets:", "met" if r["targets_met"] else "MISSED")
        results.append(r)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(results, indent=1))
    return 0 if results[0]["targets_met"] else 1


def met(r: dict) -> bool:
    return (r["server_5xx"] == 0 and r["carol_reads_during"]["p99_ms"] <= 1000
            and r["carol_reads_during"]["worst_1s_window_p99_ms"] <= 1000 and r["rss_ratio"] <= 1.2
            and r["store"] == {"admin_list": 200, "integrity_check": "ok"}
            and r["carol_after"]["state"] == "RUNNING" and r["carol_after"]["step"] > r["carol_step_before"])


def run_once(a: argparse.Namespace, per_user: str) -> dict:
    """One server, one attack; the measurements."""
    tmp = Path(tempfile.mkdtemp(prefix="elastron-abuse-"))
    (tmp / "data" / "corpus").mkdir(parents=True)
    (tmp / "data" / "corpus" / "a.py").write_text("x = 1\n" * 1000)
    runs = tmp / "runs"
    (runs / "ops-manual-run" / "checkpoints" / "step-1").mkdir(parents=True)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ELASTRON_RUNS_ROOT": str(runs), "ELASTRON_API_TOKEN": ADMIN,
           "ELASTRON_USER_TOKENS": f"alice={ALICE},bob={BOB},carol={CAROL}", "ELASTRON_QUOTAS": "alice=1:1,bob=1:1",
           "ELASTRON_MAX_LIVE_JOBS": "2", "ELASTRON_DATA_ROOTS": str(tmp / "data"),
           "ELASTRON_OBJECT_STORES": "s3://ckpts,hdfs://nn:8020/jobs", "ELASTRON_MAX_REQUESTS_PER_USER": per_user}
    env.pop("RAY_ADDRESS", None)  # a private local Ray, started by the server
    env.setdefault("RAY_raylet_start_wait_time_s", "120")  # a loaded machine starts a raylet slowly
    log = open(tmp / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "api.cli", "serve", "--port", str(port)], cwd=ROOT, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    proc = psutil.Process(server.pid)
    c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    hdr = lambda tok: {"Authorization": f"Bearer {tok}", "content-type": "application/json"}  # noqa: E731
    result: dict = {"load_before": os.getloadavg()}
    try:
        wait(lambda: _ok(c, "/healthz") or server.poll() is not None, 300, "the server's start (a private local Ray)")
        if server.poll() is not None:
            raise RuntimeError(f"the server exited ({server.returncode}); its log: {tmp / 'serve.log'}")
        job = c.post(J, json={"spec": CAROL_SPEC}, headers=hdr(CAROL)).json()["id"]
        read = lambda: c.get(f"{J}/{job}", headers=hdr(CAROL)).json()  # noqa: E731
        wait(lambda: read()["state"] == "RUNNING" and (read()["step"] or 0) > 0, 300, "carol's job training")
        other = c.post(J, json={"spec": spec(name="bob's")}, headers=hdr(BOB)).json()["id"]
        table = kinds(tmp, other)
        for name, (method, path, body) in table.items():  # one of each first: lazy imports are not growth
            c.request(method, path, content=body or None, headers=hdr(ALICE))
        time.sleep(2)
        rss0 = proc.memory_info().rss
        stop = threading.Event()
        reads: list[tuple[float, float, int]] = []
        rss: list[int] = []

        def reader():
            rc = httpx.Client(base_url=c.base_url, timeout=30)
            i = 0
            while not stop.is_set():
                path = f"{J}/{job}" if i % 2 == 0 else f"{J}/{job}/metrics?limit=100"
                t = time.perf_counter()
                code = rc.get(path, headers=hdr(CAROL)).status_code
                reads.append((time.monotonic(), time.perf_counter() - t, code))
                i += 1
                stop.wait(0.05)

        def sampler():
            while not stop.is_set():
                rss.append(proc.memory_info().rss)
                stop.wait(0.2)

        threads = [threading.Thread(target=reader, daemon=True), threading.Thread(target=sampler, daemon=True)]
        for t in threads:
            t.start()
        time.sleep(10)  # carol's reads before the attack
        t_attack = time.monotonic()
        step_before = read()["step"]
        codes: dict[str, dict[int, int]] = {k: {} for k in table}
        order = list(table.items())
        clients = [httpx.Client(base_url=c.base_url, timeout=30) for _ in range(a.concurrency)]

        def hostile(i: int):
            name, (method, path, body) = order[i % len(order)]
            tok = ALICE if i % 2 == 0 else BOB
            try:
                r = clients[i % a.concurrency].request(method, path, content=body or None, headers=hdr(tok))
                code = r.status_code
            except httpx.HTTPError:
                code = -1
            return name, code

        with ThreadPoolExecutor(a.concurrency) as pool:
            for rnd in range(a.rounds):
                if time.monotonic() - t_attack > a.deadline:
                    break
                for name, code in pool.map(hostile, range(rnd * a.concurrency, (rnd + 1) * a.concurrency)):
                    codes[name][code] = codes[name].get(code, 0) + 1
        t_end = time.monotonic()
        time.sleep(2)
        stop.set()
        for t in threads:
            t.join(10)
        for cl in clients:
            cl.close()
        after = read()
        listed = c.get(J, headers=hdr(ADMIN))
        db = sqlite3.connect(f"file:{runs / 'elastron.db'}?mode=ro", uri=True)
        integrity = db.execute("PRAGMA integrity_check").fetchone()[0]
        db.close()
        before_reads = [d for t, d, _ in reads if t < t_attack]
        during = [(t, d) for t, d, _ in reads if t_attack <= t <= t_end]
        windows: dict[int, list[float]] = {}
        for t, d in during:
            windows.setdefault(int(t - t_attack), []).append(d)
        result.update({
            "concurrency": a.concurrency, "rounds": a.rounds, "attack_s": round(t_end - t_attack, 1),
            "hostile_requests": sum(sum(v.values()) for v in codes.values()), "codes": codes,
            "server_5xx": sum(n for v in codes.values() for code, n in v.items() if code >= 500 or code < 0),
            "carol_reads_before": {"n": len(before_reads), "p50_ms": 1e3 * pct(before_reads, 0.5),
                                   "p99_ms": 1e3 * pct(before_reads, 0.99), "max_ms": 1e3 * max(before_reads)},
            "carol_reads_during": {"n": len(during), "p50_ms": 1e3 * pct([d for _, d in during], 0.5),
                                   "p99_ms": 1e3 * pct([d for _, d in during], 0.99),
                                   "max_ms": 1e3 * max(d for _, d in during),
                                   "worst_1s_window_p99_ms": 1e3 * max(pct(w, 0.99) for w in windows.values())},
            "carol_read_codes": sorted({code for _, _, code in reads}),
            "rss_before_mb": rss0 / 2**20, "rss_peak_mb": max(rss) / 2**20, "rss_ratio": max(rss) / rss0,
            "carol_step_before": step_before, "carol_after": {"state": after["state"], "step": after["step"]},
            "store": {"admin_list": listed.status_code, "integrity_check": integrity},
            "load_after": os.getloadavg()})
    finally:
        c.close()
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    return result


def _ok(c: httpx.Client, path: str) -> bool:
    try:
        return c.get(path).status_code == 200
    except httpx.HTTPError:
        return False


def _print(r: dict) -> None:
    print(f"load average before {r['load_before'][0]:.1f}, after {r['load_after'][0]:.1f}")
    print(f"{r['hostile_requests']} hostile requests ({r['concurrency']} at once x {r['rounds']} rounds) in "
          f"{r['attack_s']} s; 5xx or no answer: {r['server_5xx']}")
    for name, codes in r["codes"].items():
        print(f"  {name:24s} {dict(sorted(codes.items()))}")
    for when in ("before", "during"):
        x = r[f"carol_reads_{when}"]
        print(f"carol's reads {when:6s}: n={x['n']} p50 {x['p50_ms']:.1f} ms, p99 {x['p99_ms']:.1f} ms, "
              f"max {x['max_ms']:.1f} ms" + (f", worst 1 s window p99 {x['worst_1s_window_p99_ms']:.1f} ms"
                                             if when == "during" else ""))
    print(f"carol's read codes {r['carol_read_codes']}; her job {r['carol_after']} (step {r['carol_step_before']} "
          "when the attack began)")
    print(f"server RSS {r['rss_before_mb']:.0f} MB before, peak {r['rss_peak_mb']:.0f} MB ({r['rss_ratio']:.2f}x)")
    print(f"store: {r['store']}")


if __name__ == "__main__":
    sys.exit(main())
