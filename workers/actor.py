"""The body of one worker (one rank): a plain class the coordinator runs as a Ray actor.

A worker outlives layouts: `join()` forms (or re-forms) the process group and builds the trainer for a
layout, resuming from the latest committed checkpoint; `leave()` drops both but keeps the process (and
its imported torch) alive, so a planned resize costs a process-group re-form, not a process start.
Knows nothing of Ray beyond being called (and, for a worker that outlives its coordinator, watching that
coordinator: `watch_owner`); knows nothing of HTTP.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parallel.planner import Plan
    from workers.config import JobConfig
    from workers.report import (Joined, Memory, Resharded, Salvaged, SetUpAfter, StepMetrics, Standing, Taken, Trained,
                                Warmed, WorkerInfo)

logger = logging.getLogger(__name__)


def watch_owner(name: str, namespace: str, placement: Callable[[], Any], *, every_s: float = 2.0,
                misses: int = 2) -> None:
    """End this process once the named actor that owns it (the job's coordinator) is gone for good:
    `misses` lookups in a row that find no actor by that name. A detached worker outlives its
    coordinator's process so that a restarted coordinator can take it over; a coordinator that is not
    coming back (stopped, deleted, out of restarts) must not leave it holding its slot. A coordinator
    Ray is restarting keeps its name, and a lookup that fails otherwise (the GCS busy) is no miss.
    `placement()`: the placement group holding its slot (`Worker.placement`), released first; releasing
    it ends an actor that runs in it, the exit is for one that does not (a claimed standby)."""
    import ray

    missed = 0
    while True:
        time.sleep(every_s)
        try:
            ray.get_actor(name, namespace=namespace)
            missed = 0
        except ValueError:
            missed += 1
        except Exception:
            logger.debug("lookup of owner %s/%s failed", namespace, name, exc_info=True)
            continue
        if missed >= misses:
            break
    logger.warning("coordinator %s/%s is gone for good: this worker ends", namespace, name)
    from ray.util.placement_group import remove_placement_group

    try:
        if (pg := placement()) is not None:
            remove_placement_group(pg)
    finally:
        os._exit(0)


def release_dropped() -> None:
    """Free what a dropped layout held, now, and give the freed memory back to the system.

    An FSDP-wrapped model is a reference cycle (torch's FSDP state and hooks point back at their
    modules), so its parameters and gradients are freed only by a full run of the cyclic garbage
    collector, which Python starts by counting Python objects, not bytes: in a worker it may not run for
    many layouts, each one's model and gradients held meanwhile. And glibc keeps most of what is freed
    (tensors below its mmap threshold live in its heaps) for later allocations rather than returning it:
    `malloc_trim(0)` returns the free pages. A worker drops a layout once per reconfiguration; the
    collection walks only what the worker created since it started (`Worker.__init__` freezes the rest),
    so both together cost some tens of milliseconds. Called only where the worker holds no process group
    (after its group is destroyed, before the next forms), so nothing the collection finalises can touch a
    group in use."""
    gc.collect()
    _malloc_trim()


_libc: Any = None


def _available_memory() -> int | None:
    """Bytes of memory available to new allocations (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _malloc_trim() -> None:
    """glibc's malloc_trim(0), where there is one (Linux with glibc); a no-op elsewhere."""
    global _libc
    if _libc is None:
        import ctypes

        try:
            lib = ctypes.CDLL(None)
            lib.malloc_trim.argtypes = [ctypes.c_size_t]
            _libc = lib
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


class Worker:
    def __init__(self, cfg: JobConfig, run_dir: str, *, threads: int = 1, owner: tuple[str, str] | None = None):
        """`owner`: (name, namespace) of the named actor whose coordinator started this worker as a
        detached actor; the worker ends itself once that actor is gone for good (`watch_owner`)."""
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        import torch

        torch.set_num_threads(threads)
        import workers.reshard  # noqa: F401  (here, not in a joiner's first transfer: ~1 s of imports)
        import workers.trainer  # noqa: F401
        from workers.config import JobConfig

        # What the process imported (torch, Ray: most of its objects) lives as long as it does: out of the
        # collector's sight, the collections `release_dropped` runs walk only what the worker makes.
        gc.freeze()
        if not isinstance(cfg, JobConfig):  # e.g. a caller still sending the spec as a dict
            raise TypeError(f"Worker needs the JobConfig parsed where the spec entered, got {type(cfg).__name__}")
        self.cfg = cfg  # not parsed again here; its data.path is checked where the data is read
        self.run_dir = Path(run_dir)
        self.trainer = None
        self.rank: int | None = None
        self.handover = None
        """This worker's shards of the old layout, between `hand_over()` and its `reshard()`."""
        self.received = None
        """The state a `reshard()` delivered for the new layout, until `join(adopt=True)` takes it."""
        self._rows: list[StepMetrics] = []
        self._plan: Plan | None = None
        """The plan of the training group it is in (`join`), while it is."""
        self._broken = False
        """A `run` raised since the last `join`: its state cannot be trusted as it stands."""
        self.warmed: Warmed | None = None
        """What each one-time cost took (`warm_up`), once paid; None: not warmed up."""
        self._reservation = None
        """The placement group holding this worker's slot when it runs outside one: a standby, once
        claimed as a member (`claim`)."""
        self.snapshots = None
        """This rank's peer snapshots (workers.snapshots.PeerSnapshots) of the group it is, or last was,
        in: kept through a failure (`salvage`) and a failed transfer, replaced by the next `join`."""
        self._called_off = threading.Event()
        """Set by `abort`: a rendezvous in progress (`join`, `reshard`) stops waiting for its peers."""
        self._store: Any = None
        """The store `open_store` opened for the next group this worker hosts as its rank 0 (a
        `torch.distributed.TCPStore`), until that group's `join` or `reshard` takes it."""
        self._after_first_step: float | None = None
        """Set by `join` (the group's timeout): the first step `run` trains is followed by
        `_set_up_after_first_step`."""
        if owner is not None:
            threading.Thread(target=watch_owner, args=(*owner, self.placement), name="watch-owner",
                             daemon=True).start()

    # -- placement and rendezvous --------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        """Where it runs, and the placement group holding its slot (for a coordinator that takes it over
        to release; None: a standby not claimed yet)."""
        import ray

        from workers.report import WorkerInfo

        return WorkerInfo(node_id=ray.get_runtime_context().get_node_id(), ip=ray.util.get_node_ip_address(),
                          pid=os.getpid(), pg=self.placement(), warmed=self.warmed)

    def warm_up(self) -> Warmed | None:
        """A standby pays its process's one-time costs while it waits (`workers.warmup`), so that once
        claimed it starts at the speed of a warm worker. A warm-up that fails is logged and leaves the
        worker usable (cold). Returns what each cost took (None: it failed)."""
        from workers.compile_cache import job_cache_key
        from workers.config import job_device_type
        from workers.warmup import warm_up

        try:
            self.warmed = warm_up(job_device_type(self.cfg), cache_key=job_cache_key(self.cfg.name, self.run_dir))
        except Exception:
            logger.warning("the warm-up of this standby worker failed; it stays usable, cold", exc_info=True)
        return self.warmed

    def placement(self):
        """The placement group holding this worker's slot: the one it runs in, or the one it was claimed
        with; None for a standby (started on its node reserving nothing) not claimed yet."""
        from ray.util.placement_group import get_current_placement_group

        return self._reservation or get_current_placement_group()

    def claim(self, pg) -> WorkerInfo:
        """A standby becomes a member: once `pg` (one bundle of a worker's resources, pinned to this node
        by its `node:IP` resource where IPs are unique) is placed on this worker's node, it holds this
        worker's slot and is released with it. Raises if `pg` landed on another node (nodes sharing an
        IP, as simulated ones do, leave only its soft target: the slot here was not free yet). Returns
        `info()`."""
        import ray
        from ray.util import placement_group_table

        ray.get(pg.ready())
        here = ray.get_runtime_context().get_node_id()
        if here not in (placement_group_table(pg).get("bundles_to_node_id") or {}).values():
            raise RuntimeError(f"no free slot on node {here[:8]} for this standby worker")
        self._reservation = pg
        return self.info()

    def open_store(self) -> int:
        """Open the store of the next group this worker hosts as its rank 0, listening from now on: its
        port. Called before the peers are told the address, so none of them finds it not yet listening
        (`workers.runtime.open_store`); the next `join` or `reshard` here as rank 0 at that port takes it.
        A store opened earlier and never taken (its group's call failed) closes."""
        from workers.runtime import open_store

        self._store = open_store()
        return self._store.port

    # -- group membership ------------------------------------------------------------------------------
    def join(self, *, rank: int, world_size: int, master_addr: str, master_port: int, plan: Plan,
             adopt: bool = False, timeout_s: float = 120.0) -> Joined:
        """Join a process group as `rank` and build the trainer for `plan` (layout and micro batch, as the
        planner chose them), resuming from the latest committed checkpoint, if any,
        or, with `adopt`, from the state the last `reshard()` delivered. Returns the step training will
        continue from."""
        from workers.trainer import Trainer

        if adopt and self.received is None:
            raise RuntimeError("join(adopt=True) without a completed reshard on this worker")
        if not adopt:  # e.g. the fallback after a failed transfer: what it left behind is stale
            self.handover = self.received = None
        cpu0 = time.process_time()
        self.leave()
        t0 = time.perf_counter()
        device, pg_parts = self._init_group(rank, world_size, master_addr, master_port, timeout_s)
        t1 = time.perf_counter()
        self.trainer = Trainer(self.cfg, plan=plan, device=device,
                               run_dir=self.run_dir).build(resume=not adopt, init_weights=not adopt,
                                                           checkpoints_later=adopt)
        t2 = time.perf_counter()
        if adopt:
            got, self.received = self.received, None
            self.trainer.adopt(got.pieces, got.optimizer_steps, got.state)
            got = None  # the received buffers, and the old shards a survivor kept pieces of: freed now
            _malloc_trim()  # no collection while the new group lives (nothing cyclic was dropped here)
        self.rank, self._plan, self._broken = rank, plan, False
        t3 = time.perf_counter()
        self._drop_snapshots()
        self._after_first_step = timeout_s
        from workers.report import Joined, Seconds

        return Joined(step=self.trainer.step, parts=Seconds.of({
            "pg_s": t1 - t0, **{f"pg.{k}": v for k, v in pg_parts.items()},
            "build_s": t2 - t1, "adopt_s": t3 - t2,
            **{f"build.{k}": v for k, v in self.trainer.build_times.items()},
            "drop_snapshots_s": time.perf_counter() - t3, "cpu_s": time.process_time() - cpu0}))

    def _set_up_after_first_step(self) -> SetUpAfter:
        """What the group's later steps need and its first does not, set up after that first step
        (collective: every rank trains the same steps): the peer snapshots of this group, and the
        checkpoint manager of a group formed from moved state (`Trainer.start_checkpoints`). Returns the
        seconds each part took and the snapshots' host memory."""
        from workers.report import SetUpAfter, Seconds

        timeout_s, self._after_first_step = self._after_first_step, None
        t0 = time.perf_counter()
        build = Seconds.of(self.trainer.start_checkpoints())
        t1 = time.perf_counter()
        self._start_snapshots(timeout_s)
        return SetUpAfter(build=build, snapshots_s=time.perf_counter() - t1, checkpoints_s=t1 - t0,
                          snapshot_bytes=self.snapshots.memory_bytes if self.snapshots is not None else 0)

    def _start_snapshots(self, timeout_s: float) -> None:
        """Peer snapshots for the group formed last (collective on every rank), unless off
        (`checkpoint.peer_interval: 0`), of no use (`parallel.reshard: storage` never forms a group
        from memory) or a lone rank; the previous group's are dropped first. Their rounds wait for a
        peer at most `timeout_s`, as the group's collectives do."""
        import torch.distributed as dist

        from parallel.live import hold
        from workers.pace import Pace
        from workers.snapshots import PeerSnapshots

        self._drop_snapshots()
        if self.cfg.checkpoint.peer_interval <= 0 or self.cfg.parallel.reshard != "live" or dist.get_world_size() < 2:
            return
        shard = sum(t.numel() * t.element_size()
                    for t in hold(self.trainer.model, self.trainer.optimizer).tensors.values())
        ck = self.cfg.checkpoint
        # set up after the group's first step: it formed at the step before, where its first snapshot
        # may be due (taken right after this set-up)
        pace = Pace(every=ck.peer_interval, budget=ck.peer_budget, start=self.trainer.step - 1,
                    cap=max(ck.peer_interval, ck.interval_steps))
        self.snapshots = PeerSnapshots.start(self._node_id(), shard_bytes=shard, available_bytes=_available_memory(),
                                             timeout_s=timeout_s, pace=pace)
        if self.snapshots is not None:  # a round copies the shards beside the next step's forward and backward
            self.snapshots.guard(self.trainer.optimizer)

    def _drop_snapshots(self) -> None:
        """Free the copies of the previous group's snapshots, without waiting for its round in flight:
        `leave()` has let a sound group's round end, and a broken group's round waits on a dead peer until
        its bound ends it (it holds only its two buffers until then): waiting for it would delay the new
        group's first step."""
        if self.snapshots is not None:
            self.snapshots.close(timeout_s=0.0)
            self.snapshots = None

    @staticmethod
    def _node_id() -> str:
        try:
            import ray

            if ray.is_initialized():  # else get_runtime_context() would connect to any Ray cluster it finds
                return ray.get_runtime_context().get_node_id()
        except Exception:
            pass
        # not in a Ray actor (a test or a script driving the worker directly)
        return os.environ.get("ELASTRON_NODE_ID") or socket.gethostname()

    def _init_group(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float):
        """Join the process group; returns the device and the seconds of the group's parts
        (`workers.runtime.init_process_group`: the rendezvous, the connections)."""
        from workers.runtime import init_process_group, pick_device

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        device = pick_device(self.cfg.resources.device)
        self._called_off.clear()  # an abort sent before this call was meant for an earlier one
        store, self._store = self._store, None
        if store is not None and (rank != 0 or store.port != master_port):
            store = None  # opened for a group that never formed: this group's rank 0 hosts its own
        parts = init_process_group(device, timeout_s=timeout_s, cancelled=self._called_off.is_set, store=store)
        return device, parts

    # -- live resharding (workers.reshard) ---------------------------------------------------------------
    def hand_over(self) -> int:
        """Keep this rank's shards and the JSON state (waiting for a save in flight), then leave the
        training group: the state stays in this process for the transfer. Returns the step."""
        from workers.reshard import hand_over

        if self.trainer is None:
            raise RuntimeError("worker has not joined a group")
        self.handover = hand_over(self.trainer)
        step = self.trainer.step
        self.leave()
        return step

    def abort(self) -> bool:
        """Abort this rank's process groups. Called on the actor's control lane (its own thread) while
        another call may be stuck in a collective with a dead peer, so that call raises instead of
        waiting out the collective timeout (NCCL). Gloo needs no abort: its collectives raise at once
        when a peer's sockets close; one stuck on a silently vanished host is left to the salvage
        deadline. A rendezvous still gathering its ranks (a peer died before joining) is called off.
        Returns whether there was a group to abort."""
        import torch.distributed as dist

        self._called_off.set()
        if not dist.is_initialized():
            return False
        if dist.get_backend() != "gloo":
            dist.distributed_c10d._abort_process_group()
        return True

    def salvage(self, *, save_timeout_s: float = 2.0) -> Salvaged:
        """After a peer failed: keep this rank's shards for healing from peers, if `workers.trust` says
        they can be trusted, and leave the broken group. The facts it reports: whether it had a trainer,
        whether the failure struck after a weight update, whether a checkpoint save was left running."""
        from workers.report import Salvaged
        from workers.reshard import hand_over_salvaged
        from workers.runtime import destroy_process_group
        from workers.trust import StateFacts, trust

        t, self.trainer, self.handover, self.received = self.trainer, None, None, None
        snaps = self.snapshots
        if snaps is not None:
            # not waited for: a round with a dead peer waits on it until its bound (a SIGKILLed peer ends
            # no pending send or receive); each copy it keeps counts once its own receive has ended
            snaps.wait(timeout_s=0.0)
        copies = {"snapshots": snaps.holdings(), "old_rank": snaps.rank} if snaps is not None else {}
        try:
            state = t.salvage_state() if t is not None else None
            decided = trust(StateFacts(has_trainer=t is not None, updated_mid_step=t is not None and state is None,
                                       save_running=t is not None and not t.close(timeout_s=save_timeout_s)))
            if decided.held:
                self.handover = hand_over_salvaged(t, state)
                return Salvaged(held=True, step=t.step, old_rank=t.rank, rows=self._finished_rows(t),
                                snapshots=copies.get("snapshots", {}))
            # a process that is not reusable is stopped, and the copies it holds with it
            return Salvaged(held=False, why=decided.why, reusable=decided.reusable,
                            **(copies if decided.reusable else {}))
        finally:
            destroy_process_group()
            self.rank = self._plan = None
            t = state = None
            release_dropped()

    def _finished_rows(self, t) -> tuple[StepMetrics, ...]:
        """The metrics rows of the steps `t` finished in the last `run` call (and its last step's, if
        that call raised after it), oldest first: what a coordinator that lost the call's answer lacks."""
        rows = list(self._rows)
        last = t.last_metrics
        if last is not None and (not rows or rows[-1].step < last.step):
            rows.append(last)
        return tuple(rows)

    def reshard(self, *, rank: int, world_size: int, master_addr: str, master_port: int, old_plan: Plan,
                new_plan: Plan, old_rank: int | None, new_rank: int | None, old_to_group: dict[int, int],
                new_to_group: dict[int, int], nodes: dict[int, str], snapshot_step: int | None = None,
                timeout_s: float = 120.0) -> Resharded:
        """Take part in the transfer group (old ranks and joiners) and run the exchange plan; a rank of
        the new layout keeps what it received for `join(adopt=True)`. `snapshot_step`: the old ranks'
        state comes from the peer snapshots of that step (this worker sends the copies of every old
        rank `old_to_group` maps to it) instead of the live shards. Returns the bytes received."""
        from workers.reshard import Handover, exchange
        from workers.runtime import destroy_process_group

        cpu0 = time.process_time()
        self.leave()
        if snapshot_step is not None and old_rank is not None:
            if self.snapshots is None:
                raise RuntimeError("reshard from snapshots on a worker that holds none")
            helds, state = self.snapshots.handover(snapshot_step, [r for r, g in old_to_group.items() if g == rank])
            for held in helds.values():
                # the join that adopts drops these snapshots right after (`_drop_snapshots`): a new rank here
                # may keep their buffers as its own moments instead of copying them (`parallel.live.fill`)
                held.movable = True
            own = helds.pop(old_rank, None)
            if own is None:  # it serves only others' copies: the first one stands in as its own
                old_rank, own = next(iter(helds.items()))
                helds.pop(old_rank)
            self.handover = Handover(held=own, state=state, extra=helds)
        t0 = time.perf_counter()
        try:
            device, pg_parts = self._init_group(rank, world_size, master_addr, master_port, timeout_s)
            t1 = time.perf_counter()
            got = exchange(self.handover, model=self.cfg.model.build(), old=old_plan.layout,
                           new=new_plan.layout, old_rank=old_rank, new_rank=new_rank,
                           old_to_group=old_to_group, new_to_group=new_to_group, nodes=nodes, device=device)
        finally:
            self.handover = None
            t2 = time.perf_counter()
            destroy_process_group()
        self.received = got if new_rank is not None else None
        release_dropped()  # the shards this worker only sent (a leaver: all of them)
        from workers.report import Resharded, Seconds

        return Resharded(bytes_received=got.bytes_received,
                         timings=Seconds.of({"rendezvous": t1 - t0, **{f"rendezvous.{k}": v for k, v in pg_parts.items()},
                                             **got.timings, "leave": time.perf_counter() - t2,
                                             "cpu_s": time.process_time() - cpu0}))

    def leave(self) -> None:
        """Drop the trainer and the process group; the process stays warm for the next layout."""
        from workers.runtime import destroy_process_group

        dropped = self.trainer is not None
        if self.snapshots is not None and dropped and not self._broken:
            self.snapshots.wait()  # its round in flight uses the group: let it end first (a sound group: soon)
        if self.trainer is not None:
            try:
                self.trainer.close()
            finally:
                self.trainer = None
        destroy_process_group()
        self.rank = self._plan = self._after_first_step = None
        if dropped:
            release_dropped()

    # -- training --------------------------------------------------------------------------------------
    def run(self, *, until_step: int, steps: int) -> Trained:
        """Train `steps` steps (fewer if `until_step` comes first). Every rank gets the same count from
        the coordinator: a rank that stopped on its own clock would leave the others blocked in the next
        step's collectives. Short calls keep the coordinator responsive between them. Returns the steps'
        rows (with what each peer snapshot cost) and the last committed checkpoint's step."""
        from workers.report import Trained

        if self.trainer is None:
            raise RuntimeError("worker has not joined a group")
        out = self._rows = []  # kept if a step raises: a salvage reports the steps this call did finish
        try:
            for _ in range(steps):
                if self.trainer.step >= until_step:
                    break
                busy = self.snapshots is not None and self.snapshots.in_flight()
                t0 = time.perf_counter()
                out.append(self.trainer.train_step())
                took = time.perf_counter() - t0
                if self._after_first_step is not None:
                    out[-1] = replace(out[-1], set_up_after=self._set_up_after_first_step())
                if (snaps := self.snapshots) is not None:
                    snaps.pace.step_ended(took, busy=busy)
                    if snaps.pace.due(self.trainer.step):
                        out[-1] = replace(out[-1], snapshot=self._snapshot())
        except BaseException:
            self._broken = True
            raise
        return Trained(rows=tuple(out), committed_step=self._committed_step())

    def _snapshot(self) -> Taken:
        from parallel.live import hold

        t = self.trainer
        return self.snapshots.take(t.step, hold(t.model, t.optimizer), t.checkpoint_state())

    def _committed_step(self) -> int:
        ck = getattr(self.trainer, "checkpointer", None)
        return (ck.last_committed_step if ck is not None else None) or 0

    def standing(self) -> Standing:
        """Whether this worker still trains as a sound rank of its group, for a coordinator taking it over
        after the one that formed the group died (`WorkerGroup.carry_on`). On the default lane, so it
        answers once the call the lost coordinator sent has ended."""
        import torch.distributed as dist

        from workers.report import Standing

        t = self.trainer
        if t is None or self._plan is None:
            return Standing(sound=False, why="it is in no training group")
        if self._broken:
            return Standing(sound=False, why="a step of its last call failed")
        if not dist.is_initialized():
            return Standing(sound=False, why="its process group is gone")
        return Standing(sound=True, rank=self.rank, plan=self._plan, step=t.step,
                        committed_step=self._committed_step(), rows=self._finished_rows(t))

    def checkpoint(self, *, blocking: bool = True) -> int:
        """Save at the current step; `blocking` waits until it is committed (a resize through storage),
        else the save stages during the next step and commits in the background (the durable copy
        after a live reshard)."""
        if self.trainer is None:
            raise RuntimeError("worker has not joined a group")
        self.trainer.save_checkpoint(blocking=blocking)
        return self.trainer.step

    def step(self) -> int | None:
        return None if self.trainer is None else self.trainer.step

    def memory(self) -> Memory:
        """This process's memory now (for a soak or an operator; answers on the control lane while a call
        trains): its RSS and, on CUDA, torch's `memory_allocated`/`memory_reserved` on its device."""
        import psutil
        import torch

        from workers.report import Memory

        pid, rss = os.getpid(), psutil.Process().memory_info().rss / 2**20
        t = self.trainer  # the default lane may drop it meanwhile
        device = t.device if t is not None else None
        if device is None or device.type != "cuda":
            return Memory(pid=pid, rss_mb=round(rss, 1), device=str(device) if device is not None else "none")
        return Memory(pid=pid, rss_mb=round(rss, 1), device=str(device),
                      cuda_allocated_mb=round(torch.cuda.memory_allocated(device) / 2**20, 1),
                      cuda_reserved_mb=round(torch.cuda.memory_reserved(device) / 2**20, 1))
