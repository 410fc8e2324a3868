"""The coordinator's recent per-step metrics: a bounded map from step to row, so that a job of a million
steps holds a few thousand rows, not a million. The job store and RUN_DIR/metrics.jsonl keep the whole
history; the API pulls what is new (`since`) every sync, and fills a gap wider than this from
metrics.jsonl (`StoreSync._fill_gap`, service.server.store_sync)."""

from __future__ import annotations

from workers.report import StepMetrics

KEEP = 4096
"""Rows a coordinator keeps: ~30 minutes of 0.5 s steps, far more than a sync interval's worth."""


class RecentMetrics(dict):
    """dict[step, StepMetrics] that forgets its oldest rows beyond `keep`. Steps arrive in order (a redone step
    replaces its row in place), so `since` walks back from the newest instead of sorting them all."""

    def __init__(self, keep: int = KEEP):
        super().__init__()
        self.keep = keep
        self._in_order = True
        self.val_loss: float | None = None
        """The newest evaluation's val_loss: train.eval_interval makes it rarer than the rows kept."""

    def __setitem__(self, step: int, row: StepMetrics) -> None:
        if step not in self and self and step < next(reversed(self)):
            self._in_order = False  # a step older than the newest, evicted before: sort in since()
        super().__setitem__(step, row)
        if row.val_loss is not None:
            self.val_loss = row.val_loss
        while len(self) > self.keep:
            del self[next(iter(self))]

    def since(self, step: int) -> list[StepMetrics]:
        """Rows after `step`, oldest first, in O(rows returned)."""
        if not self._in_order:
            return [self[s] for s in sorted(self) if s > step]
        out = []
        for s in reversed(self):
            if s <= step:
                break
            out.append(self[s])
        return out[::-1]
