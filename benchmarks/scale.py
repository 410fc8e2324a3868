"""Elastron's per-event work at 32 ... 4,096 ranks: pure code, a fake pool, and for `groups` gloo processes.

    .venv/bin/python benchmarks/scale.py plan --model 8b --old dp_shard=64,tp=8 --new dp_shard=60,tp=8
    .venv/bin/python benchmarks/scale.py plan --model 70b --old dp_shard=64,tp=8,pp=2 --new dp_shard=60,tp=8,pp=2
    .venv/bin/python benchmarks/scale.py plan --model 8b --old dp=2 --new dp=1 --baseline 4edddd6
    .venv/bin/python benchmarks/scale.py manifest --model 8b --layout dp_shard=64,tp=8 --new dp_shard=60,tp=8
    .venv/bin/python benchmarks/scale.py coordinator --workers 256 1024 4096 --profile
    .venv/bin/python benchmarks/scale.py groups --ranks 2 4 8 16 --layout "dp={n}"

plan: the live reshard's planning as one worker does it (`workers.reshard.exchange`): two `BoxMap`s
  and `plan_rank`, for a sample of workers (`--ranks N` spread over the world, plus the first and last
  survivor and joiner, or `--ranks all`); survivors keep their rank (new rank r is old rank r), nodes
  hold `--per-node` consecutive ranks. Reported: the slowest sampled worker's plan time, and per worker
  the transfers, the pieces it sends over the network and the messages it posts (one per piece of at
  least `parallel.live.PACK_BELOW` bytes, one per peer for the smaller ones), the largest of each.
  `--baseline REV` also times, on the same box in the same run, the whole-plan flow of git revision REV
  (its `sharding.boxes` of both layouts and `exchange.plan_exchange`, which every worker used to run).
manifest: the checkpoint metadata a rank reads on load, built in memory as `CheckpointManager` writes it
  (nothing written) and read by the loader's own functions through a storage that counts bytes: format
  4, the top manifest's preamble and header (`validate.read_manifest_text(head=True)`), its sections of
  the parameters of the rank's pipeline stage (`validate.read_sections`), checked against the model's
  shapes, then (`validate.read_indexes`) of each index of the saved ranks whose boxes meet the rank's
  own (`placement.index_keys_for`; each index keyed, as a placed save writes it: one chunk record per
  key it writes, then every record's block digests) the preamble, the header, the records of the keys
  it meets and the digests of the blocks whose rows meet its boxes;
  beside it the whole format-2 manifest every rank read before (up to
  `--format2-max` ranks). Both against "its own boxes' metadata": the index the rank would write for
  every box it holds under the loading layout. Sampled loading ranks (`--ranks`); also the time of a
  rank's metadata work: finding its indexes, parsing and merging them and checking their cover of its
  boxes (load), and choosing the boxes it writes (save).
coordinator: the fake pool of tests/fakes.py with `--workers` workers (8 per node; 256, 1,024 and 4,096 by
  default, one after the other in one process) running an `8b` job, through every event kind in turn:
  start, drain (a preemption notice on one node), join (a node added), resize (the user asks for 3/4 of
  the workers), kill (the node of rank 0 dies without notice: every survivor's salvage answer, then the
  group healed or restored), kill_snapshots (the same, the survivors holding no live state they can vouch
  for but peer snapshots: the group forms from those copies), kill_uncovered (the same with no copy of
  the dead node's ranks left: restored from storage) and takeover (a new coordinator reading the job's events takes over the group its lost
  predecessor left running). Per event: decision -> call (from the event to the start of the group call
  that carries it out: `reshard`, `form` or `carry_on`), the coordinator's own seconds (its steps until
  it runs the new plan, less the time inside the fake group's calls), the group calls it made, and with
  `--profile` the functions with the most own time; and each event's coordinator seconds at the largest
  size over the same at `--base` (both in the same run, on the same box).
groups: real gloo processes at each of `--ranks`: per rank, the established TCP connections after the
  TCP store, the default group (gloo connects every pair: N - 1 per rank), `Layout.build_mesh` and one
  more group of the whole world (the peer snapshots and the checkpoint's coordination each make one per
  group formation), and the `new_group` calls `build_mesh` made; `--fake LAYOUT...`: the same calls at any
  size on torch's fake backend (no process started).

Shapes: the `8b` preset, and `70b` = dim 8192, 80 layers, 64 heads, 8 KV heads, ffn 28672, vocab
128256 (Llama-3-70B), fp32 state (itemsize 4) with both AdamW moments.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.config import ModelConfig, model_config  # noqa: E402
from parallel.exchange import plan_rank  # noqa: E402
from parallel.layout import Layout  # noqa: E402
from parallel.sharding import BoxMap  # noqa: E402

STATES = ("exp_avg", "exp_avg_sq")
ITEMSIZE = 4
PACK_BELOW = 64 << 10  # parallel.live.PACK_BELOW (not imported: parallel.live imports torch)


def model(name: str) -> ModelConfig:
    if name == "70b":
        return model_config("8b", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                            vocab_size=128256)
    return model_config(name)


def shapes_of(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from models.llama import build_model

    return {n: tuple(p.shape) for n, p in build_model(cfg).named_parameters()}  # meta device: no memory


def sample_ranks(old: Layout, new: Layout, n: int | None) -> list[int]:
    world = max(old.world_size, new.world_size)
    if n is None:
        return list(range(world))
    edge = {0, min(old.world_size, new.world_size) - 1, min(old.world_size, new.world_size), world - 1,
            old.world_size - 1, new.world_size - 1}
    return sorted({r for r in edge if 0 <= r < world} | {round(i * (world - 1) / max(1, n - 1)) for i in range(n)})


def plan_one(cfg: ModelConfig, shapes, old: Layout, new: Layout, w: int, per_node: int):
    """One worker's plan as `workers.reshard.exchange` computes it; returns (seconds, transfers)."""
    world = max(old.world_size, new.world_size)
    node = {r: f"n{r // per_node}" for r in range(world)}
    survivors = {r: r for r in range(min(old.world_size, new.world_size))}
    gc.collect()
    t = time.perf_counter()
    plan = plan_rank(BoxMap(old, shapes, cfg.n_layers, STATES, tied=cfg.tie_embeddings),
                     BoxMap(new, shapes, cfg.n_layers, STATES, tied=cfg.tie_embeddings),
                     old_rank=w if w < old.world_size else None, new_rank=w if w < new.world_size else None,
                     alive=range(old.world_size), same_worker=survivors, old_node=node, new_node=node)
    return time.perf_counter() - t, plan


def messages(plan, w: int) -> int:
    """Messages worker `w` posts (sends and receives), as `parallel.live.transfer` groups them."""
    pairs: dict[tuple[str, int], list[int]] = defaultdict(list)
    for t in plan:
        if t.src == w and t.dst == w:
            continue
        pairs[("send", t.dst) if t.src == w else ("recv", t.src)].append(t.box.numel * ITEMSIZE)
    return sum((1 if any(b < PACK_BELOW for b in bs) else 0) + sum(b >= PACK_BELOW for b in bs)
               for bs in pairs.values())


def load_revision(rev: str):
    """`sharding` and `exchange` modules of git revision `rev`, importable side by side with today's."""
    tmp = Path(tempfile.mkdtemp(prefix="scale-baseline-"))
    mods = {}
    for name in ("sharding", "exchange"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:parallel/{name}.py"], check=True,
                              capture_output=True, text=True).stdout
        text = text.replace("from parallel.sharding import", "from baseline_sharding import")
        (tmp / f"baseline_{name}.py").write_text(text)
    sys.path.insert(0, str(tmp))
    for name in ("sharding", "exchange"):
        spec = importlib.util.spec_from_file_location(f"baseline_{name}", tmp / f"baseline_{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[f"baseline_{name}"] = mods[name]
        spec.loader.exec_module(mods[name])
    return mods


def cmd_plan(a) -> dict:
    cfg = model(a.model)
    shapes = shapes_of(cfg)
    old, new = Layout.parse(a.old), Layout.parse(a.new)
    ranks = sample_ranks(old, new, None if a.ranks == "all" else int(a.ranks))
    rows = []
    for w in ranks:
        best = math.inf
        for _ in range(a.reps):
            dt, plan = plan_one(cfg, shapes, old, new, w, a.per_node)
            best = min(best, dt)
        sent = [t for t in plan if t.src == w and t.dst != w]
        got = [t for t in plan if t.dst == w and t.src != w]
        rows.append({"rank": w, "plan_s": best, "transfers": len(plan), "sent_pieces": len(sent),
                     "received_pieces": len(got), "messages": messages(plan, w),
                     "bytes_sent": sum(t.box.numel for t in sent) * ITEMSIZE,
                     "bytes_received": sum(t.box.numel for t in got) * ITEMSIZE})
    slow = max(rows, key=lambda r: r["plan_s"])
    out = {"model": a.model, "old": str(old), "new": str(new), "old_ranks": old.world_size,
           "new_ranks": new.world_size, "sampled_workers": len(rows), "slowest_plan_s": slow["plan_s"],
           "slowest_rank": slow["rank"], "median_plan_s": sorted(r["plan_s"] for r in rows)[len(rows) // 2],
           **{f"max_{k}": max(r[k] for r in rows) for k in ("transfers", "sent_pieces", "received_pieces",
                                                               "messages", "bytes_sent", "bytes_received")}}
    if a.baseline:
        base = load_revision(a.baseline)
        gc.collect()
        t = time.perf_counter()
        ob = base["sharding"].boxes(old, shapes, cfg.n_layers, STATES, tied=cfg.tie_embeddings)
        nb = base["sharding"].boxes(new, shapes, cfg.n_layers, STATES, tied=cfg.tie_embeddings)
        whole = base["exchange"].plan_exchange(ob, nb, same_worker={r: r for r in range(min(old.world_size,
                                                                                         new.world_size))})
        out["baseline"] = {"rev": a.baseline, "every_worker_plan_s": time.perf_counter() - t,
                           "transfers_in_all": len(whole)}
    if a.verbose:
        out["workers"] = rows
    return out


def _block_rows(b) -> int:
    """Rows per checksummed block, as `writer.block_rows_for` gives them (1 MiB blocks)."""
    row = math.prod(b.sizes[1:]) * ITEMSIZE
    return max(1, min(1 << 20, max(64 << 10, row * b.sizes[0] // 16)) // max(row, 1))


DIGEST = "0" * 32  # xxh3-128 hex, the default algorithm's length


def _index(rank: int, boxes: dict, shared: bool = False, keys: list[str] | None = None) -> bytes:
    """The bytes of the format-3 index a rank writes for `boxes` (key -> Box), as `CheckpointManager`
    writes it: one file, one chunk per key with its block digests, the step counters of its parameters;
    keyed by `keys` (the checkpoint's key order) as a placed save writes it, one JSON document without."""
    from parallel.checkpoint.entries import Chunk, FileEntry
    from parallel.checkpoint.formats import shard_prefix
    from parallel.checkpoint.index import Index
    from parallel.checkpoint.keys import param_of

    name = f"{shard_prefix(rank)}00.safetensors"
    size = sum(b.numel for b in boxes.values()) * ITEMSIZE
    chunks = {}
    for key, b in boxes.items():
        rows = _block_rows(b)
        chunks[key] = Chunk(file=name, offsets=b.offsets, sizes=b.sizes, block_rows=rows,
                            digests=(DIGEST,) * -(-b.sizes[0] // rows))
    return Index(rank=rank, step=1, shared=shared,
                 files={name: FileEntry(size=size, digest=DIGEST, algorithm="xxh3-128", blockwise=True)}
                 if boxes else {}, chunks=chunks,
                 optimizer_steps={param_of(k): 1000 for k in boxes if k.startswith("optim.")}).to_bytes(keys)


class _Counted:
    """A read-only `Storage` over index files built on demand (`make(name) -> bytes`), counting the bytes
    and requests the loader's reads (`validate.read_indexes`) ask for: its header reads (preamble and
    header), record reads (whole JSON lines) and digest reads apart."""

    def __init__(self, make) -> None:
        self.make, self.cache = make, {}
        self.head_bytes = self.record_bytes = self.digest_bytes = self.requests = 0
        self.top_bytes = self.top_requests = 0
        """Of the top manifest (``manifest.json``), counted apart from the indexes."""
        self.by_kind: Counter = Counter()
        """Ranged reads of the indexes by what they read: head, records, digests."""

    def join(self, *parts: str) -> str:
        return "/".join(parts)

    def exists(self, path: str) -> bool:
        return True

    def _data(self, path: str) -> bytes:
        name = path.rsplit("/", 1)[-1]
        if name not in self.cache:
            self.cache[name] = self.make(name)
        return self.cache[name]

    def read_bytes(self, path: str) -> bytes:
        data = self._data(path)
        self.requests += 1
        self.record_bytes += len(data)
        return data

    def read_ranges(self, path: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        from parallel.checkpoint.formats import MANIFEST_NAME, PREAMBLE_BYTES

        data = self._data(path)
        out = [data[a:a + n] for a, n in ranges]
        if path.endswith(MANIFEST_NAME):
            self.top_bytes += sum(map(len, out))
            self.top_requests += len(ranges)
            return out
        self.requests += len(ranges)
        for (a, _), got in zip(ranges, out):
            if a <= PREAMBLE_BYTES:
                self.head_bytes += len(got)
                self.by_kind["head"] += 1
            elif got.endswith(b"\n"):
                self.record_bytes += len(got)
                self.by_kind["records"] += 1
            else:  # the digest section: hex, no newline
                self.digest_bytes += len(got)
                self.by_kind["digests"] += 1
        return out


def _format2_bytes(bm: BoxMap, lay: Layout, shapes) -> tuple[int, int]:
    """(Bytes, chunks) of the format-2 manifest of the same checkpoint (every distinct box once)."""
    from parallel.checkpoint.entries import Chunk, FileEntry, TensorEntry
    from parallel.checkpoint.manifest import Manifest

    tensors: dict[str, list] = defaultdict(list)
    file_bytes: Counter = Counter()
    seen: set = set()
    for r in range(lay.world_size):
        for key, b in bm.held(r).items():
            if (key, b) in seen:
                continue
            seen.add((key, b))
            rows = _block_rows(b)
            name = f"shard-r{r:05d}-00.safetensors"
            file_bytes[name] += b.numel * ITEMSIZE
            tensors[key].append(Chunk(file=name, offsets=b.offsets, sizes=b.sizes, block_rows=rows,
                                      digests=(DIGEST,) * -(-b.sizes[0] // rows)))
    files = {n: FileEntry(size=size, digest=DIGEST, algorithm="xxh3-128", blockwise=True)
             for n, size in file_bytes.items()}
    m = Manifest(step=1, files=files, state={"layout": lay.to_dict()}, tensors={
        k: TensorEntry(shape=shapes[k.split(".", 1)[1] if k.startswith("model.") else k.split(".", 2)[2]],
                       dtype="float32", chunks=tuple(cs)) for k, cs in tensors.items()})
    return len(m.to_json().encode()), len(seen)


def cmd_manifest(a) -> dict:
    """Checkpoint metadata one loading rank reads (format 4: the top manifest's header and its stage's
    sections, then of the indexes of the saved ranks whose boxes meet its own the preamble, the header
    and the records of the keys it meets; format 2: the whole manifest), against its own boxes'
    metadata."""
    from parallel.checkpoint.entries import TensorEntry
    from parallel.checkpoint.formats import FORMAT_VERSION, MANIFEST_NAME, index_name
    from parallel.checkpoint.keys import key_order
    from parallel.checkpoint.manifest import Manifest
    from parallel.checkpoint.placement import Placement, index_keys_for, shared, writes
    from parallel.checkpoint.validate import read_indexes, read_manifest_text, read_sections
    from parallel.sharding import stage_of

    cfg = model(a.model)
    shapes = shapes_of(cfg)
    old = Layout.parse(a.layout)
    new = Layout.parse(a.new) if a.new else old
    saved = Placement(layout=old, n_layers=cfg.n_layers, tied=cfg.tie_embeddings,
                      params={n: (s, "float32") for n, s in shapes.items()})
    sbm = saved.boxmap(STATES)
    lbm = BoxMap(new, shapes, cfg.n_layers, STATES, tied=cfg.tie_embeddings)
    keys = {f"{p}{n}": s for n, s in shapes.items() for p in ("model.", *(f"optim.{st}." for st in STATES))}
    order = key_order(keys)
    top = Manifest(step=1, tensors={k: TensorEntry(shape=s, dtype="float32", chunks=()) for k, s in keys.items()},
                   files={}, state={"layout": old.to_dict()}, format_version=FORMAT_VERSION, placement=saved.to_dict(),
                   indexes=old.world_size, scope="top").to_json().encode()
    names = {index_name(w, sh): (w, sh) for w in range(old.world_size) for sh in (False, True)}
    expected = {n: (s, "float32") for n, s in shapes.items()}

    def stage_params(r: int) -> list[str]:  # what the loading rank's model holds (`state.named_state`)
        p = r // (new.world_size // new.pp)
        return [n for n in shapes if stage_of(n, cfg.n_layers, new.pp) == p
                or (cfg.tie_embeddings and n == "tok_embeddings.weight" and p == new.pp - 1)]

    def index_of(name: str) -> bytes:  # what saving rank w writes: the boxes the rule gives it
        if name == MANIFEST_NAME:
            return top
        w, sh = names[name]
        held = sbm.held(w)
        return _index(w, {k: b for k, b in held.items() if writes(sbm, w, k)
                          and shared(sbm, k, sbm.tile_of(w, k)) == sh}, sh, order)

    storage = _Counted(index_of)
    rows = []
    for r in sample_ranks(new, new, None if a.ranks == "all" else int(a.ranks)):
        mine = lbm.held(r)
        gc.collect()
        t = time.perf_counter()
        need = index_keys_for(sbm, mine)
        rule_s = time.perf_counter() - t
        for name in (index_name(w, sh) for w, sh in need):  # built before the clock starts
            storage._data(name)
        storage.head_bytes = storage.record_bytes = storage.digest_bytes = storage.requests = 0
        storage.top_bytes = storage.top_requests = 0
        storage.by_kind.clear()
        boxes = {k: (b.offsets, b.sizes) for k, b in mine.items()}
        t = time.perf_counter()  # the load's metadata work: read, parse, check shapes, merge, check its cover
        text, _ = read_manifest_text(storage, "ckpt", head=True)
        m, problems = read_sections(storage, "ckpt", Manifest.from_json(text), stage_params(r))
        problems += m.model_problems(expected)
        indexes, more = read_indexes(storage, "ckpt", m, need, gap=a.gap,
                                     digest_gap=a.gap if a.digest_gap is None else a.digest_gap, boxes=boxes)
        problems += more
        part, more = m.merged(indexes, whole=False)
        problems += more + part.coverage_problems(boxes)
        load_s = time.perf_counter() - t
        own = len(_index(r, mine, keys=order))
        read = storage.top_bytes + storage.head_bytes + storage.record_bytes + storage.digest_bytes
        rows.append({"rank": r, "indexes_read": len(need), "shared_read": sum(sh for _, sh in need),
                     "top_read": storage.top_bytes, "top_requests": storage.top_requests,
                     "requests_by_kind": dict(storage.by_kind),
                     "sections_read": sorted(m.sections.read),
                     "head_bytes": storage.head_bytes, "record_bytes": storage.record_bytes,
                     "digest_bytes": storage.digest_bytes, "requests": storage.requests, "read_bytes": read,
                     "own_bytes": own, "boxes": len(mine), "ratio": read / own, "index_ratio": (read - storage.top_bytes) / own,
                     "plan_s": rule_s, "load_metadata_s": load_s, "problems": len(problems)})
    save = []
    for r in sample_ranks(old, old, 8):  # what a saving rank does with metadata: its boxes, the rule
        t = time.perf_counter()
        held = sbm.held(r)
        mine = [k for k in held if writes(sbm, r, k)]
        save.append(time.perf_counter() - t)
    worst = max(rows, key=lambda x: x["ratio"])
    out = {"model": a.model, "saved": str(old), "loaded": str(new), "ranks": f"{old.world_size} -> {new.world_size}",
           "top_bytes": len(top), "max_top_read": max(x["top_read"] for x in rows), "ranks_timed": len(rows),
           "max_ratio": worst["ratio"], "median_ratio": sorted(x["ratio"] for x in rows)[len(rows) // 2],
           "max_index_ratio": max(x["index_ratio"] for x in rows),
           # A rank with no box to load has an own metadata of an empty index: its ratio is no measure.
           "max_ratio_loading": max((x["ratio"] for x in rows if x["boxes"]), default=None),
           "worst": worst, "max_indexes_read": max(x["indexes_read"] for x in rows),
           "max_requests": max(x["requests"] for x in rows),
           "max_load_metadata_s": max(x["load_metadata_s"] for x in rows), "max_plan_s": max(x["plan_s"] for x in rows),
           "max_save_rule_s": max(save), "problems": sum(x["problems"] for x in rows)}
    if old.world_size <= a.format2_max:
        nbytes, chunks = _format2_bytes(sbm, old, shapes)
        out.update({"format2_bytes": nbytes, "format2_chunks": chunks,
                    "format2_ratio_worst_rank": nbytes / worst["own_bytes"]})
    if a.verbose:
        out["rows"] = rows
    return out


# The group calls the coordinator makes; time inside them is the fake pool's, not the coordinator's.
GROUP_CALLS = ("scale_to", "prewarm", "warm", "keep_standby", "stop_members", "form", "adopt", "carry_on", "salvage",
               "reshard", "run", "checkpoint", "leave", "shutdown")
CARRY_OUT = ("reshard", "form", "carry_on")
"""The calls that carry an event out: the live transfer, a group formed, a group left running adopted."""


class _Clock:
    """Wall and CPU time inside the fake group's calls (outermost call only), when each kind of call first
    started, and the calls made (by name) since `reset`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.inside, self.inside_cpu, self.depth, self.first, self.calls = 0.0, 0.0, 0, {}, Counter()
        self.source: str | None = None
        """What a live transfer moved the state from (the sound group, survivors' live state, peer snapshots)."""

    def wrap(self, name: str, fn):
        clock = self

        def timed(self_, *args, **kw):
            clock.first.setdefault(name, time.perf_counter())
            clock.calls[name] += 1
            clock.depth += 1
            t, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(self_, *args, **kw)
            finally:
                clock.depth -= 1
                if clock.depth == 0:
                    clock.inside += time.perf_counter() - t
                    clock.inside_cpu += time.process_time() - cpu
        return timed


def _timed_group(clock: _Clock, cluster, left: dict):
    """A fake group class on `cluster` whose calls `clock` times; survivors of a failure keep their state
    (a salvage), and a group taken over after a restart is the one `left` holds (members, plan, step)."""
    from tests.fakes import fake_group_cls

    base = fake_group_cls(cluster, 50)

    def reshard(self, old, new, nodes, **kw):
        clock.source = ("peer snapshots" if kw.get("snapshot_step") is not None else
                        "survivors' live state" if kw.get("survivors") is not None else "the sound group")
        return base.reshard(self, old, new, nodes, **kw)

    def adopt(self):
        if not left:
            return 0
        self.members, self.plan, self.step = list(left["members"]), left["plan"], left["step"]
        return len(self.members)

    attrs = {"heals": True, "adopt": adopt, "reshard": reshard}
    return type("Timed", (base,), {**attrs, **{n: clock.wrap(n, attrs.get(n) or getattr(base, n))
                                               for n in GROUP_CALLS}})


def _event(c, clock: _Clock, kind: str, trigger, done, *, limit: int = 40, profile: bool = False) -> dict:
    """Fire `trigger()` (it may return the coordinator that takes over from `c`), then step `c` (reading the cluster first) until `done(c)`: the event's row. decision
    -> call: from the trigger to the first call that carries it out; coordinator_s: the wall time until
    done less the time inside the fake group's calls and the watcher's polls (`watcher_s`: a thread of
    its own in a real coordinator); coordinator_cpu_s: the same in this process's CPU time (what a
    loaded box's waits for a core leave out); top: with `profile`, the functions with the most own time (cProfile
    slows the run down: take the times from a run without it)."""
    import cProfile
    import pstats

    clock.reset()
    prof = cProfile.Profile() if profile else None
    gc.collect()
    t0, cpu0 = time.perf_counter(), time.process_time()
    if prof:
        prof.enable()
    c = trigger() or c
    steps, watch, watch_cpu = 0, 0.0, 0.0
    while steps < limit:
        t, cpu = time.perf_counter(), time.process_time()
        c.watcher.poll()  # the watcher's thread does this in a real coordinator
        watch += time.perf_counter() - t
        watch_cpu += time.process_time() - cpu
        if done(c):
            break
        c.step()
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if prof:
        prof.disable()
    started = min((clock.first[n] for n in CARRY_OUT if n in clock.first), default=math.nan)
    row = {"event": kind, "done": bool(done(c)), "steps": steps, "wall_s": wall, "group_s": clock.inside,
           "watcher_s": watch, "coordinator_s": wall - clock.inside - watch,
           "coordinator_cpu_s": cpu - clock.inside_cpu - watch_cpu, "decision_to_call_s": started - t0,
           "carried_out_by": next((n for n in CARRY_OUT if n in clock.first), None), "moved_from": clock.source,
           "group_calls": dict(clock.calls), "world": c.plan.world_size if c.plan else None,
           "layout": str(c.plan.layout) if c.plan else None, "state": str(c.state.name)}
    if prof:
        st = pstats.Stats(prof)
        own = sorted(((v[2], k) for k, v in st.stats.items()), reverse=True)  # (tottime, (file, line, fn))
        row["top"] = [{"fn": f"{Path(k[0]).name}:{k[1]}:{k[2]}", "own_s": round(t, 4), "calls": st.stats[k][1]}
                      for t, k in own[:8]]
    return row


def coordinator_run(workers: int, dp_mode: str, profile: bool) -> dict:
    """Every event kind at `workers` fake workers (8 per node), in turn: start, drain (a notice on one node),
    join (a node added), resize (the user asks for 3/4 of the workers), kill (the node of rank 0 dies:
    survivors salvaged, the group healed from them), kill_snapshots (the same, formed from the survivors'
    peer snapshots), kill_uncovered (the same, no copy left of the dead node's ranks: restored), takeover (a new coordinator takes over the group its lost predecessor left running).
    Each event ends when the group call that carries it out was made and the group trained its first step
    (for the takeover: runs the lost plan)."""
    from service.control.commands import SetWorkers
    from service.control.coordinator import Coordinator, CoordinatorOptions
    from service.control.job import Job
    from parallel.peers import pair
    from service.control.states import Running
    from tests.fakes import FakeCluster
    from workers.config import JobConfig

    n_nodes = workers // 8
    cluster = FakeCluster({f"node{i:05d}": 8 for i in range(n_nodes)})
    cfg = JobConfig.from_dict({
        "model": {"preset": "8b"},
        "data": {"source": "synthetic", "seq_len": 16},
        "train": {"steps": 10_000_000, "global_batch_size": workers * 4, "micro_batch_size": 1},
        "parallel": {"min_workers": 8, "max_workers": workers, "gpus_per_node": 8, "reshard": "live",
                     "dp_mode": dp_mode, "memory_budget_gb": 80},
        "checkpoint": {"interval_steps": 50},
    })
    clock, left = _Clock(), {}
    group_cls = _timed_group(clock, cluster, left)
    rows = []
    with tempfile.TemporaryDirectory() as run_dir:
        def coordinator() -> Coordinator:
            c = Coordinator(Job.of(cfg, job_id="scale", run_dir=Path(run_dir)), watcher=cluster.watcher(),
                            options=CoordinatorOptions(settle_seconds=0.0, max_restarts=100, owner="scale-job"))
            c.worker_group_cls = group_cls
            c.group_probe = lambda nodes, timeout_s: {n for n in nodes if n not in cluster.dead}
            return c

        c = coordinator()

        def carried_out(c) -> bool:  # the event's group call made, the new group through its first step
            return (any(n in clock.first for n in CARRY_OUT) and isinstance(c.state, Running)
                    and c.state.record is None)

        def steady(n=2):
            for _ in range(n):
                c.watcher.poll()
                c.step()

        def event(kind: str, trigger, done=carried_out):
            rows.append(_event(c, clock, kind, trigger, done, profile=profile))
            steady()

        def snapshots_kept() -> dict[int, dict[int, tuple[int, ...]]]:
            """Each rank's peer snapshot of this step, in its own memory and its buddy's on another node
            (`parallel.peers.pair`, as workers.snapshots keeps them): {rank: {old rank: (step,)}}."""
            members, step = c.group.members, c.group.step
            kept = {r: {r: (step,)} for r in range(len(members))}
            for r, buddy in enumerate(pair(members).buddy):
                kept[buddy][r] = (step,)
            return kept

        event("start", lambda: None)
        last = f"node{n_nodes - 1:05d}"
        event("drain", lambda: cluster.draining.update({last: int(time.time() * 1000) + 30_000}))
        cluster.draining.pop(last)
        del cluster.nodes[last]  # the drained node is gone
        steady()
        event("join", lambda: cluster.nodes.update({f"node{n_nodes:05d}": 8}))
        event("resize", lambda: c.send(SetWorkers(workers=workers * 3 // 4)))
        # kills: the node of rank 0, without notice (spare nodes are left after the resize)
        event("kill", lambda: cluster.dead.add(c.group.members[0]))
        # the survivors cannot vouch for their live state, but hold peer snapshots: formed from those
        group_cls.heals, group_cls.snapshots = False, snapshots_kept()
        event("kill_snapshots", lambda: cluster.dead.add(c.group.members[0]))
        # the same, but no survivor holds a copy of the shards rank 0 holds (each rank keeps only its own
        # copy, and those of rank 0's shards are not kept): no cover, the group restores from storage, and
        # the events name the ranks whose copies were lost
        lay = c.plan.layout
        group_cls.snapshots = {r: {r: (c.group.step,)} for r in range(c.group.size) if lay.place(r) != lay.place(0)}
        event("kill_uncovered", lambda: cluster.dead.add(c.group.members[0]))
        group_cls.heals, group_cls.snapshots = True, None
        left.update(members=list(c.group.members), plan=c.plan, step=c.group.step)
        lost = c.plan
        # the lost coordinator's workers outlive it; a new one reads its events and takes them over
        rows.append(_event(c, clock, "takeover", coordinator,
                           lambda new: new is not c and "carry_on" in clock.first and isinstance(new.state, Running)
                           and new.plan == lost, profile=profile))
    return {"workers": workers, "events": rows}


def cmd_coordinator(a) -> dict:
    """`coordinator_run` `--repeat` times at each of `--workers`, the sizes interleaved, in one process;
    per event the median of its coordinator seconds (wall and CPU) and of decision -> call (the samples
    kept), and the median at the largest size over the same at `--base` (both in the same run, the box's
    load shared).
    With `--profile`, once more under cProfile for where the time goes (its overhead kept out of the
    times)."""
    samples: dict[int, list[dict]] = {w: [] for w in a.workers}
    for _ in range(a.repeat):
        for w in a.workers:
            samples[w].append(coordinator_run(w, a.dp_mode, False))
    runs = []
    for w in a.workers:
        rows = samples[w][0]["events"]
        for i, r in enumerate(rows):
            for key in ("wall_s", "coordinator_s", "coordinator_cpu_s", "decision_to_call_s", "group_s", "watcher_s"):
                got = [run["events"][i][key] for run in samples[w]]
                r[key], r[f"{key}_samples"] = statistics.median(got), got
        if a.profile:
            tops = {r["event"]: r["top"] for r in coordinator_run(w, a.dp_mode, True)["events"]}
            for r in rows:
                r["top"] = tops[r["event"]]
        runs.append({"workers": w, "events": rows})
    by = {run["workers"]: {r["event"]: r for r in run["events"]} for run in runs}
    big = max(a.workers)
    ratios = {k: {m: by[big][k][m] / by[a.base][k][m] for m in ("coordinator_s", "coordinator_cpu_s")
                  if by[a.base][k][m] > 0} for k in by[big] if a.base in by and k in by[a.base]}
    return {"command": " ".join(sys.argv[1:]), "load_average": list(os.getloadavg()), "dp_mode": a.dp_mode,
            "repeat": a.repeat, f"ratio_{big}_over_{a.base}": ratios, "runs": runs}


def _groups_rank(rank: int, world: int, port: int, layout: str, out) -> None:
    """One rank of `cmd_groups`: its established TCP connections after each stage, and the `new_group`
    calls `build_mesh` made."""
    import psutil
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    me = psutil.Process()

    def sockets() -> int:
        return sum(1 for c in me.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED)

    made = []
    make = c10d._new_group_with_tag
    c10d._new_group_with_tag = lambda *a, **kw: made.append(1) or make(*a, **kw)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    row = {"store": sockets()}
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    row["default_group"] = sockets()
    Layout.parse(layout.format(n=world)).build_mesh("cpu")
    row["mesh"], row["mesh_new_group_calls"] = sockets(), len(made)
    dist.new_group(backend="gloo")  # a second group of the whole world, as snapshots and checkpoints make
    dist.barrier()
    row["world_group"] = sockets()
    dist.barrier()
    dist.destroy_process_group()
    out.put((rank, row))


def _fake_new_group_calls(layout: Layout) -> int:
    """The `new_group` calls `Layout.build_mesh` makes on the last rank of a fake group (torch's `fake`
    backend: no process, no connection) of the layout's size."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore

    made = []
    make = c10d._new_group_with_tag
    c10d._new_group_with_tag = lambda *a, **kw: made.append(1) or make(*a, **kw)
    try:
        dist.init_process_group("fake", store=FakeStore(), rank=layout.world_size - 1, world_size=layout.world_size)
        layout.build_mesh("cpu")
        dist.destroy_process_group()
    finally:
        c10d._new_group_with_tag = make
    return len(made)


def cmd_groups(a) -> dict:
    """`--ranks` real gloo processes per size: each rank's established TCP connections after the TCP store,
    the default group, `Layout.build_mesh` of `--layout` and one more group of the whole world (what
    the peer snapshots and the checkpoint's coordination each make per group formation), the counts
    cumulative; and the `new_group` calls `build_mesh` made on the rank. Largest over the ranks."""
    import multiprocessing as mp
    import socket

    ctx = mp.get_context("spawn")
    runs = []
    for n in a.ranks:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = ctx.Queue()
        procs = [ctx.Process(target=_groups_rank, args=(r, n, port, a.layout, q)) for r in range(n)]
        for p in procs:
            p.start()
        rows = dict(q.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
        worst = {k: max(r[k] for r in rows.values()) for k in rows[0]}
        runs.append({"ranks": n, "layout": a.layout.format(n=n), "max_per_rank": worst,
                     "total": {k: sum(r[k] for r in rows.values()) for k in rows[0]}})
    fake = {text: _fake_new_group_calls(Layout.parse(text)) for text in a.fake}
    return {"command": " ".join(sys.argv[1:]), "load_average": list(os.getloadavg()), "runs": runs,
            "fake_new_group_calls": fake}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--model", default="8b", choices=["8b", "70b", "1b", "small", "tiny"])
    p.add_argument("--old", required=True)
    p.add_argument("--new", required=True)
    p.add_argument("--ranks", default="16", help="workers to time: a count spread over the world, or 'all'")
    p.add_argument("--reps", type=int, default=1, help="repetitions per worker (the fastest is kept)")
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--baseline", help="git revision whose whole-plan flow to time beside it")
    p.add_argument("--verbose", action="store_true")
    m = sub.add_parser("manifest")
    m.add_argument("--model", default="8b", choices=["8b", "70b", "1b", "small", "tiny"])
    m.add_argument("--layout", required=True, help="the layout the checkpoint is saved under")
    m.add_argument("--new", help="the layout it is loaded under (default: the same)")
    m.add_argument("--ranks", default="16", help="loading ranks to measure: a count spread over the world, or 'all'")
    m.add_argument("--format2-max", type=int, default=512, help="also build the format-2 manifest up to this many ranks")
    m.add_argument("--gap", type=int, default=None,
                   help="read records (and digests) of an index at most this many bytes apart in one range (default: "
                        "the loader's)")
    m.add_argument("--digest-gap", type=int, default=None,
                   help="read block digests at most this many bytes apart in one range (default: --gap, else the loader's)")
    m.add_argument("--verbose", action="store_true")
    c = sub.add_parser("coordinator")
    c.add_argument("--workers", type=int, nargs="+", default=[256, 1024, 4096], help="fake workers (8 per node)")
    c.add_argument("--repeat", type=int, default=5, help="runs per size (the median is reported)")
    c.add_argument("--base", type=int, default=1024, help="the size the largest is compared with")
    c.add_argument("--profile", action="store_true", help="cProfile each event: the functions with most own time")
    c.add_argument("--dp-mode", default="replicate", choices=["shard", "replicate", "auto"],
                   help="replicate: a node's death heals from the survivors; shard: it restores from storage")
    g = sub.add_parser("groups")
    g.add_argument("--ranks", type=int, nargs="*", default=[2, 4, 8, 16], help="world sizes (one gloo process per rank)")
    g.add_argument("--layout", default="dp={n}", help="the mesh built, {n} standing for the world size")
    g.add_argument("--fake", nargs="*", default=[], help="layouts whose build_mesh new_group calls to count on a "
                   "fake group (any size: no process is started)")
    a = ap.parse_args()
    out = {"plan": cmd_plan, "manifest": cmd_manifest, "coordinator": cmd_coordinator,
           "groups": cmd_groups}[a.cmd](a)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
