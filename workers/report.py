"""What a step reports, and where it goes: one `StepMetrics` per optimizer step, written by rank 0 to
RUN_DIR/metrics.jsonl (the run's record, which the API reads) and to the sinks users watch (TensorBoard
and, optionally, Weights & Biases: workers.sinks). The sinks are best effort: a run never stops because
an event file or W&B could not be written; it logs why, once, and trains on."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from parallel.layout import Layout
from parallel.planner import Plan
from workers.config import JobConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Seconds:
    """Seconds per named part of one operation, in the order the parts ran. The names are open-ended
    (a trainer's build parts as `build.*`, the send/recv's as `send_recv.*`: `workers.reshard`), so they
    are data here, not fields; a dict only at the JSON edge (`to_dict`)."""

    parts: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, parts: Mapping[str, float]) -> Seconds:
        return cls(tuple((str(k), float(v)) for k, v in parts.items()))

    @classmethod
    def slowest(cls, each: Iterable[Seconds]) -> Seconds:
        """Per part, the most seconds any of `each` took (the ranks of one collective call), in the
        first's order."""
        each = list(each)
        if not each:
            return cls()
        return cls(tuple((k, max(s.get(k) for s in each)) for k in each[0].names()))

    def names(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.parts)

    def get(self, name: str, default: float = 0.0) -> float:
        return next((v for k, v in self.parts if k == name), default)

    def to_dict(self) -> dict[str, float]:
        return dict(self.parts)


@dataclass(frozen=True, kw_only=True, slots=True)
class Warmed:
    """Seconds each one-time cost of a warm-up took (`workers.warmup.warm_up`)."""

    import_s: float
    """Importing the compiler, DTensor, FSDP2, pipelining and trainer modules."""
    cuda_context_s: float
    """Creating the CUDA context and the caching allocator (about 0 off CUDA)."""
    first_step_s: float
    """One training step of a tiny model through the `Trainer`."""

    def to_dict(self) -> dict[str, float]:
        """Keyed by the phase names of `workers.warmup.PHASES`."""
        return {"import": self.import_s, "cuda_context": self.cuda_context_s, "first_step": self.first_step_s}


@dataclass(frozen=True, kw_only=True, slots=True)
class SetUpAfter:
    """What a group's first step was followed by on a rank (`Worker._set_up_after_first_step`): the
    checkpoint manager of a group formed from moved state (`checkpoints_s`, its parts in `build`), the
    group's peer snapshots (`snapshots_s`) and their host memory (`snapshot_bytes`, 0: off)."""

    build: Seconds
    snapshots_s: float
    checkpoints_s: float
    snapshot_bytes: int

    def to_dict(self) -> dict[str, float | int]:
        """Flat, the build parts as `build.*`."""
        return {**{f"build.{k}": v for k, v in self.build.parts}, "snapshots_s": self.snapshots_s,
                "checkpoints_s": self.checkpoints_s, "snapshot_bytes": self.snapshot_bytes}


@dataclass(frozen=True, kw_only=True, slots=True)
class Taken:
    """What one snapshot cost the training thread (`PeerSnapshots.take`), in seconds: waiting for the
    previous round's send and receive to end (`wait_s`), the ranks' agreement on the newest step every
    rank holds whole (`agree_s`), and the wait before the last update for the previous round's copy of
    the shards into host memory (`copy_s`, `PeerSnapshots.settle`). The new round's copy, send and
    receive run in the background, beside the next step."""

    wait_s: float
    agree_s: float
    copy_s: float
    committed: int
    """The newest snapshot step every rank holds whole, as agreed in this take."""
    interval: int = 1
    """The steps until the next snapshot, as agreed in this take (`workers.pace`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    step: int
    """Optimizer steps completed, counting this one (1-based)."""
    loss: float
    lr: float
    grad_norm: float
    tokens: int
    """Tokens consumed by the whole job so far (all DP ranks)."""
    layout: Layout
    world_size: int
    time: float
    step_time: float
    tokens_per_s: float
    mfu: float | None = None
    """Model FLOPs utilisation of the whole job for this step (0..1); None where the device's peak is
    unknown (CPUs, unlisted GPUs). See workers/mfu.py."""
    val_loss: float | None = None
    """Loss on the held-out split, on steps that evaluate (train.eval_interval); None on the others."""
    snapshot: Taken | None = None
    """What the peer snapshot taken after this step cost the training thread (`Worker.run` adds it; None:
    none was taken). Not in metrics.jsonl: the row is written there before."""
    set_up_after: SetUpAfter | None = None
    """On a group's first step: what its later steps need set up after it; None on the others. Not in
    metrics.jsonl either."""

    def to_dict(self) -> dict:
        """The row as JSON-ready fields (`snapshot` and `set_up_after` only where they happened)."""
        out = asdict(self)  # the layout as Layout.to_dict's fields
        del out["snapshot"], out["set_up_after"]
        if self.snapshot is not None:
            out["snapshot"] = asdict(self.snapshot)
        if self.set_up_after is not None:
            out["set_up_after"] = self.set_up_after.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())


@dataclass(frozen=True, kw_only=True, slots=True)
class Trained:
    """What one `Worker.run` call did on a rank: the rows of the steps it trained, oldest first, and the
    step of the last committed durable checkpoint once they had run."""

    rows: tuple[StepMetrics, ...] = ()
    committed_step: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerInfo:
    """Where a worker runs and what holds its slot (`Worker.info`; `Worker.claim` answers it too, once the
    slot it was given holds it)."""

    node_id: str
    """The Ray node it runs on."""
    ip: str
    """Its node's address, where rank 0 hosts a rendezvous."""
    pid: int
    """Its process."""
    pg: Any = None
    """The placement group holding its slot, for a coordinator that takes it over to keep or release
    (None: a standby not claimed yet)."""
    warmed: Warmed | None = None
    """What its warm-up took (`Worker.warm_up`); None: not warmed up."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Joined:
    """What a worker answers once it has joined a training group (`Worker.join`)."""

    step: int
    """The step training continues from."""
    parts: Seconds = Seconds()
    """Seconds per part of the join: the process group (`pg_s`), the trainer's build (`build_s`, and
    its parts as `build.*`), the adoption of moved state (`adopt_s`), dropping the previous group's
    peer snapshots (`drop_snapshots_s`); `cpu_s`: the CPU seconds this process spent in the whole call
    (its own work, apart from waiting on the others or sharing cores with them). The new group's snapshots, and the checkpoint manager of a
    group formed from moved state, are set up after its first step: that step's metrics row says what
    they took (`set_up_after`, `Worker._set_up_after_first_step`)."""
    snapshot_bytes: int = 0
    """Host memory its peer snapshots take (0: off, or not set up yet)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Resharded:
    """What a worker answers once a live state transfer has run (`Worker.reshard`)."""

    bytes_received: int
    """Bytes it received from other workers (its own pieces are not counted)."""
    timings: Seconds = Seconds()
    """Seconds per phase of the transfer call: the rendezvous, `workers.reshard`'s phases, the leave; and
    `cpu_s`, the CPU seconds this process spent in the whole call."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Salvaged:
    """What a worker answers after a peer failed (`Worker.salvage`): whether it keeps its shards to heal
    the group from, and if it does, their step, its rank in the broken layout and the metrics rows of
    the steps its interrupted call finished; if it does not, why."""

    held: bool
    why: str | None = None
    """Why its shards cannot be trusted (when not held)."""
    reusable: bool = False
    """(When not held) whether the process can join the next group as a freshly started worker would: it
    has dropped its trainer and left the process group, and no save of it is left running."""
    step: int | None = None
    """The step its shards are at (when held)."""
    old_rank: int | None = None
    """Its rank in the layout that failed (when held)."""
    rows: tuple[StepMetrics, ...] = ()
    """The rows of the steps the interrupted call finished, oldest first (when held)."""
    snapshots: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Peer snapshots it holds: {old rank: complete snapshot steps of that rank's copy} (its own, and
    those it keeps for its buddies; `old_rank` is then set even when its live shards are not held)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Standing:
    """What a worker answers a coordinator that takes it over (`Worker.standing`): whether it is still a
    sound rank of its training group, and if so its rank, the plan it runs, its step, the last committed
    checkpoint's step and the metrics rows of its last `run` call; if not, why."""

    sound: bool
    why: str | None = None
    rank: int | None = None
    plan: Plan | None = None
    """The plan it joined with."""
    step: int | None = None
    committed_step: int = 0
    rows: tuple[StepMetrics, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class Memory:
    """What a worker's process holds now (`Worker.memory`, on the control lane): its resident set and, where
    it trains on CUDA, what torch's caching allocator has handed out and what it keeps reserved from the
    device (None elsewhere)."""

    pid: int
    rss_mb: float
    device: str
    """The trainer's device ("cpu", "cuda:0"); "none" before the worker has joined a group."""
    cuda_allocated_mb: float | None = None
    cuda_reserved_mb: float | None = None


class Reporter:
    """Rank 0's writer of step metrics; does nothing on other ranks or without a run directory."""

    def __init__(self, cfg: JobConfig, run_dir: Path | None, *, rank: int) -> None:
        self.cfg = cfg
        self.run_dir = run_dir if rank == 0 else None
        self.sinks = None
        lg = cfg.logging
        self._want_sinks = self.run_dir is not None and (lg.tensorboard or lg.wandb is not None)

    def write(self, m: StepMetrics) -> None:
        if self.run_dir is None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(m.to_json() + "\n")
        if not self._want_sinks:
            return
        try:
            if self.sinks is None:
                from workers.sinks import MetricsSinks

                lg = self.cfg.logging
                self.sinks = MetricsSinks(self.run_dir, tensorboard=lg.tensorboard,
                                          wandb=asdict(lg.wandb) if lg.wandb is not None else None,
                                          config=self.cfg.to_dict())
            self.sinks.log(m.to_dict())
        except Exception:
            self._want_sinks = False
            log.warning("metrics for TensorBoard/W&B are no longer written for this run (metrics.jsonl still "
                        "is); check logging.* in the job config and that %s is writable", self.run_dir,
                        exc_info=True)

    def close(self) -> None:
        if self.sinks is not None:
            try:
                self.sinks.close()
            except Exception:
                log.warning("closing the TensorBoard/W&B writers failed", exc_info=True)
            self.sinks = None
