"""Where users watch a run: TensorBoard event files in the run directory and, optionally, Weights & Biases.

`MetricsSinks` takes each step's metrics on rank 0 and writes them once: a resumed or resized run
appends to the same TensorBoard directory and resumes the same W&B run (its id is kept in the run
directory), and steps redone after a failure are not written again (the last written step is kept in
`RUN_DIR/tensorboard/state.json`). Every reconfiguration is written as a marked event at the first step
after it: a text entry "grow: dp_shard=2 -> dp_shard=2,tp=2 (2 -> 4 workers), resumed at step 40" and the
scalar `reconfiguration/world_size`. Under a coordinator the judge of what was a reconfiguration is its
event log, RUN_DIR/events.jsonl ("resize" events after the first start, read from where the last
writer stopped); a run without one (torchrun) marks a change of layout between two logged steps.

TensorBoard's file format is small enough to write without TensorFlow or the tensorboard package: a
file of records (length, masked CRC-32C of the length, an `Event` protobuf, masked CRC-32C of it), the
protobufs encoded by hand below (`tests/workers/test_sinks.py` reads them back with tensorboard's own
reader).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
import struct
import time
from pathlib import Path
from typing import Any

SCALARS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu")


# -- CRC-32C and protobuf, just what event files need --------------------------------------------------

def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _scalar_value(tag: str, value: float) -> bytes:
    return _field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value)


def _text_value(tag: str, text: str) -> bytes:
    tensor = _varint(1 << 3) + _varint(7) + _field(2, b"") + _field(8, text.encode())  # DT_STRING, shape [], value
    metadata = _field(1, _field(1, b"text"))  # plugin_data { plugin_name: "text" }
    return _field(1, tag.encode()) + _field(9, metadata) + _field(8, tensor)


def _event(step: int, *, values: list[bytes] | None = None, file_version: str | None = None) -> bytes:
    out = _varint(1 << 3 | 1) + struct.pack("<d", time.time()) + _varint(2 << 3) + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if values:
        out += _field(5, b"".join(_field(1, v) for v in values))
    return out


class TensorBoardWriter:
    """Appends scalar and text events to a new event file in `logdir` (one file per writer)."""

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.elastron"
        self._f = open(self.logdir / name, "ab")
        self._write(_event(0, file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._f.write(header + struct.pack("<I", _masked(header)) + data + struct.pack("<I", _masked(data)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._write(_event(step, values=[_scalar_value(k, float(v)) for k, v in values.items()]))

    def text(self, step: int, tag: str, text: str) -> None:
        self._write(_event(step, values=[_text_value(tag, text)]))

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.close()


# -- the sinks ----------------------------------------------------------------------------------------------

class MetricsSinks:
    """TensorBoard (always, under RUN_DIR/tensorboard) and W&B (when `wandb` is a dict such as
    {"project": "p", "mode": "offline"}) for one run directory; used on rank 0 only."""

    def __init__(self, run_dir: str | os.PathLike[str], *, tensorboard: bool = True,
                 wandb: dict[str, Any] | None = None, config: dict[str, Any] | None = None) -> None:
        self.dir = Path(run_dir) / "tensorboard"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tb = TensorBoardWriter(self.dir) if tensorboard else None
        self.events_path = Path(run_dir) / "events.jsonl"
        self._state_path = self.dir / "state.json"
        try:
            state = json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            state = {}
        self.last_step: int = int(state.get("last_step", 0))
        self.layout: str | None = state.get("layout")
        self.world_size: int | None = state.get("world_size")
        self.events_offset: int = int(state.get("events_offset", 0))
        self.wandb_run = None
        if wandb is not None:
            self.wandb_run = _wandb_run(Path(run_dir), wandb, config)

    def log(self, m: dict[str, Any]) -> bool:
        """Write one step's metrics (a `StepMetrics.to_dict()`-like mapping); False if the step was
        written before (redone after a failure)."""
        step = int(m["step"])
        if step <= self.last_step:
            return False
        layout = _layout_text(m.get("layout"))
        if self.events_path.exists():
            notes = self._new_reconfigurations()
        elif layout is not None and self.layout is not None and layout != self.layout:
            notes = [(f"{self.layout} -> {layout} ({self.world_size} -> {m.get('world_size')} workers)",
                      m.get("world_size"))]
        else:
            notes = []
        for note, world in notes:
            self._write(step, {"reconfiguration/world_size": float(world or 0)}, text=note)
        self._write(step, {k: float(m[k]) for k in SCALARS if m.get(k) is not None})
        if self.tb is not None:
            self.tb.flush()
        self.last_step, self.layout, self.world_size = step, layout or self.layout, m.get("world_size")
        tmp = self._state_path.with_suffix(".part")
        tmp.write_text(json.dumps({"last_step": step, "layout": self.layout, "world_size": self.world_size,
                                   "events_offset": self.events_offset}))
        os.replace(tmp, self._state_path)
        return True

    def _write(self, step: int, values: dict[str, float], *, text: str | None = None) -> None:
        if self.tb is not None:
            if text is not None:
                self.tb.text(step, "reconfiguration", text)
            self.tb.scalars(step, values)
        if self.wandb_run is not None:
            self.wandb_run.log({**values, **({"reconfiguration": text} if text is not None else {})}, step=step)

    def _new_reconfigurations(self) -> list[tuple[str, int | None]]:
        """(note, new world size) of each reconfiguration in events.jsonl since the last writer's offset;
        a line still being written is left for the next call."""
        with open(self.events_path, "rb") as f:
            f.seek(self.events_offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.events_offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash: events.py skips it too
            d = e.get("details") if isinstance(e, dict) else None
            if e.get("kind") != "resize" or not isinstance(d, dict) or d.get("old_layout") is None:
                continue  # the first start is no reconfiguration
            old, new = _layout_text(d.get("old_layout")), _layout_text(d.get("new_layout"))
            was = math.prod(v for v in d["old_layout"].values() if isinstance(v, int))
            out.append((f"{e.get('cause') or 'reconfiguration'}: {old} -> {new} ({was} -> {d.get('world_size')} "
                        f"workers), resumed at step {d.get('resumed_step')}", d.get("world_size")))
        return out

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _layout_text(layout: Any) -> str | None:
    if not isinstance(layout, dict):
        return None
    parts = [f"{k}={v}" for k, v in layout.items() if v != 1]
    return ",".join(parts) or "single process"


def _wandb_run(run_dir: Path, opts: dict[str, Any], config: dict[str, Any] | None):
    """The run's W&B run, resumed by the id kept in RUN_DIR/wandb_id when there is one."""
    try:
        import wandb
    except ImportError:
        raise ValueError("logging.wandb is set but the wandb package is not installed; pip install wandb, "
                         "or remove logging.wandb") from None
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(6)  # W&B: [a-z0-9]
    id_file.write_text(run_id + "\n")
    return wandb.init(project=opts.get("project", "elastron"), mode=opts.get("mode", "online"), id=run_id,
                      resume="allow", dir=str(run_dir), config=config or {})
