"""Progress for long jobs: a redrawn bar on a terminal, a line per ~5% (and per state change) elsewhere."""

from __future__ import annotations

import sys
import time

from api.render import table
from service.control.state import WAITING
from service.control.status import JobStatus, layout_short


def layout_text(d: dict | None) -> str:
    return layout_short(d)


class Progress:
    def __init__(self, total: int, *, stream=None, width: int = 28):
        self.total = max(1, total)
        self.stream = stream or sys.stdout
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.width = width
        self._last_pct = -1
        self._last_state = None
        self._last_draw = 0.0

    def update(self, status: JobStatus) -> None:
        step, state = status.step or 0, status.state
        pct = int(100 * step / self.total)
        loss = status.loss
        tps = status.tokens_per_s
        lay = layout_text(status.layout)
        text = (f"step {step}/{self.total}  loss {loss:.4f}" if loss is not None else f"step {step}/{self.total}")
        text += f"  val_loss {status.val_loss:.4f}" if status.val_loss is not None else ""
        text += f"  {tps:,.0f} tok/s" if tps else ""
        if not status.is_terminal:  # a finished job holds no workers; its last layout would read as current
            text += f"  layout {lay} ({status.world_size} workers)"
        text += f"  {state}"
        if state in WAITING and status.reason:  # what it waits for, e.g. "no usable layout on 2 workers"
            text += f" ({status.reason})"
        if self.tty:
            now = time.monotonic()
            if now - self._last_draw < 0.1 and state == self._last_state:
                return
            fill = int(self.width * step / self.total)
            self.stream.write(f"\r[{'#' * fill}{'.' * (self.width - fill)}] {text}\x1b[K")
            self._last_draw = now
        elif pct // 5 != self._last_pct // 5 or state != self._last_state:
            self.stream.write(text + "\n")
        self.stream.flush()
        self._last_pct, self._last_state = pct, state

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def reconfig_table(reconfigs: list[dict]) -> str:
    rows = []
    for r in reconfigs:
        secs = r.get("seconds")
        rows.append((r["cause"], f"{layout_text(r.get('old_layout'))} -> {layout_text(r.get('new_layout'))}",
                     r.get("world_size"), f"{secs:.2f}" if secs is not None else "-", r.get("steps_lost"),
                     f"{r['loss_before']:.4f}" if r.get("loss_before") is not None else "-",
                     f"{r['loss_after']:.4f}" if r.get("loss_after") is not None else "-"))
    return table(["event", "layout (dp x tp x pp)", "workers", "reconfig s", "steps redone/lost",
                  "loss before", "loss after"], rows)
