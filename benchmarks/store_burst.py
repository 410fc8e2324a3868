"""N processes join one TCP store at the same instant, as the ranks of a group do at its rendezvous: the
seconds each took to connect, on the node's own address or loopback.

torch's store resolves every peer's address to a name as it accepts it (a reverse DNS lookup on its one
event-loop thread: strace shows a PTR query per peer), so a resolver that drops replies holds every peer
queued behind that accept for glibc's resolver timeout (5 s). This measures how many of N peers are late
and by how much, without Ray or training, so the rendezvous phase of `ranks.py` can be read against it.

    .venv/bin/python benchmarks/store_burst.py --peers 8 16 32 64 --host node    # the node's address
    .venv/bin/python benchmarks/store_burst.py --peers 32 --host 127.0.0.1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import time
from datetime import timedelta


def _peer(host: str, port: int, start: float, out) -> None:
    import torch.distributed as dist

    while time.time() < start:
        time.sleep(0.001)
    t0 = time.perf_counter()
    store = dist.TCPStore(host, port, None, False, timeout=timedelta(seconds=60), wait_for_workers=False)
    store.add("joined", 1)
    out.put(time.perf_counter() - t0)


def burst(peers: int, host: str) -> dict:
    """`peers` processes connect to one store at `host` at the same instant: each one's seconds."""
    import torch.distributed as dist

    master = dist.TCPStore("0.0.0.0", 0, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    start = time.time() + 2.0  # every process started and waiting by then
    procs = [ctx.Process(target=_peer, args=(host, master.port, start, out)) for _ in range(peers)]
    for p in procs:
        p.start()
    seconds = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join()
    return {"peers": peers, "host": host, "median_s": statistics.median(seconds), "max_s": seconds[-1],
            "late_over_1s": sum(s > 1.0 for s in seconds), "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--host", default="node", help="'node': this node's address (as Ray's nodes connect); or an address")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    host = socket.gethostbyname(socket.gethostname()) if a.host == "node" else a.host
    if a.host == "node" and host.startswith("127."):
        ip = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            ip.connect(("192.0.2.1", 9))  # no packet is sent: the route's source address is the node's
            host = ip.getsockname()[0]
        finally:
            ip.close()
    rows = []
    for n in a.peers:
        for r in range(a.repeat):
            row = burst(n, host)
            rows.append({**row, "repeat": r})
            print(f"{n:4d} peers -> {host}: median {row['median_s']:.3f} s, max {row['max_s']:.3f} s, "
                  f"{row['late_over_1s']} of {n} over 1 s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
